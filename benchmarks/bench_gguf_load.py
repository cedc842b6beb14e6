"""Dequantizing a GGUF file's tensors: the `gguf` package's numpy path (the reference,
`GGUFFile.read_reference`) against `GGUFFile.read` (model/gguf_dequant.py for Q4_0 / Q4_1 /
Q8_0), alternately, on the CPU.  `python benchmarks/bench_gguf_load.py [--model FILE.gguf] [--reps 3]` (default:
the embedded SmolLM2).  Prints seconds per pass over every tensor."""
from __future__ import annotations

import argparse
import importlib.metadata
import time

import torch

from slipstream.model.gguf import GGUFFile
from slipstream.model.loader import embedded_model_path


def timed_pass(f: GGUFFile, read) -> float:
    """Seconds to dequantize every tensor of `f` with read(f, name)."""
    t = time.perf_counter()
    for name in f.tensors:
        read(f, name)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    f = GGUFFile(args.model or embedded_model_path())
    types = sorted({i.qtype.name for i in f.tensors.values()})
    print(f"{len(f.tensors)} tensors ({', '.join(types)}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, gguf {importlib.metadata.version('gguf')}")
    print("| rep | gguf.quants.dequantize | GGUFFile.read | ratio |\n|---|---|---|---|")
    for rep in range(1, args.reps + 1):
        ref, new = timed_pass(f, GGUFFile.read_reference), timed_pass(f, GGUFFile.read)
        print(f"| {rep} | {ref:.3f} s | {new:.3f} s | {ref / new:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
