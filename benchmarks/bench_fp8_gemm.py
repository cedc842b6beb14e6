#!/usr/bin/env python
"""FP8 against bf16 linears at the 8B shape's layer GEMMs (qkv, o, gate_up, down), by rows:
the milliseconds of each path as the engine runs it (docs/fp8.md, "Compute paths"), its
TFLOP/s and its weight GB/s.

    python benchmarks/bench_fp8_gemm.py [--out DIR] [--rows 1,8,32,256,8192,16384] [--tiny]

Paths: bf16 (`ops.linear.linear`: cuBLAS, the GEMV at one row), fp8-channel
(`ops.fp8_linear.fp8_linear` with per-channel weights: per-token quantization + _scaled_mm,
the FP8 GEMV at one row), fp8-block (128x128 block weights: the Triton FP8 GEMM, the GEMV at
one row), fp8-invariant (per-channel weights, batch_invariant=True: the Triton FP8 GEMM for
every M) and bf16-invariant. Each product is first checked against its reference; one CUDA
graph a (shape, rows, path) holds the product, the median of 20 replays is reported.
`--tiny`: small shapes on the CPU (the reference paths), a smoke test of this script.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from slipstream.bench.cuda_timing import time_graph  # noqa: E402
from slipstream.bench.report import write_json  # noqa: E402
from slipstream.ops.fp8_linear import fp8_linear, fp8_linear_ref  # noqa: E402
from slipstream.ops.linear import linear  # noqa: E402
from slipstream.quant.fp8 import Fp8Weight, quantize_blocks, quantize_per_channel  # noqa: E402

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SHAPES_TINY = {"qkv": (384, 256), "down": (256, 512)}


def paths(w: torch.Tensor):
    """name -> (callable x -> y, reference x -> y, weight bytes)."""
    qc, sc = quantize_per_channel(w)
    qb, sb = quantize_blocks(w, (128, 128))
    ch, bl = Fp8Weight(qc, sc), Fp8Weight(qb, sb, (128, 128))
    ref_ch = lambda x: fp8_linear_ref(x, ch, quantize_input=x.shape[0] > 1)  # noqa: E731
    ref_bl = lambda x: fp8_linear_ref(x, bl, quantize_input=x.shape[0] > 1)  # noqa: E731
    bf16 = lambda x: torch.nn.functional.linear(x, w)  # noqa: E731
    return {
        "bf16": (lambda x: linear(x, w), bf16, w.numel() * 2),
        "bf16-invariant": (lambda x: linear(x, w, batch_invariant=True), bf16, w.numel() * 2),
        "fp8-channel": (lambda x: fp8_linear(x, ch), ref_ch, ch.nbytes()),
        "fp8-block": (lambda x: fp8_linear(x, bl), ref_bl, bl.nbytes()),
        "fp8-invariant": (lambda x: fp8_linear(x, ch, batch_invariant=True),
                          lambda x: fp8_linear_ref(x, ch, quantize_input=True), ch.nbytes()),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default="1,8,32,256,8192,16384")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    dev = "cpu" if args.tiny else "cuda"
    shapes = SHAPES_TINY if args.tiny else SHAPES_8B
    rows = [int(r) for r in args.rows.split(",")] if not args.tiny else [1, 4]
    gen = torch.Generator(device=dev).manual_seed(0)
    results = []
    print(f"{'shape':8} {'rows':>6} {'path':15} {'ms':>9} {'TFLOP/s':>8} {'GB/s':>7} {'x bf16':>7}")
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).to(torch.bfloat16)
        for m in rows:
            x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
            base = None
            for path, (fn, ref, wbytes) in paths(w).items():
                torch.testing.assert_close(fn(x).float(), ref(x).float(), atol=0.1, rtol=0.05)
                ms = time_graph([lambda fn=fn: fn(x)], device=dev)
                base = ms if path == "bf16" else base
                tflops = 2 * m * n * k / ms / 1e9
                gbs = wbytes / ms / 1e6
                results.append(dict(shape=name, n=n, k=k, rows=m, path=path, ms=ms, tflops=tflops, weight_gbs=gbs,
                                    speedup_vs_bf16=base / ms))
                print(f"{name:8} {m:6d} {path:15} {ms:9.4f} {tflops:8.1f} {gbs:7.0f} {base / ms:7.2f}")
    if args.out:
        meta = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if dev == "cuda" else "cpu")
        print("wrote", write_json(args.out, "bench_fp8_gemm.json", dict(meta=meta, results=results)))


if __name__ == "__main__":
    main()
