#!/usr/bin/env python
"""Programmatic dependent launch in eager steps: does it cost launch time?

Builds the engine for a model shape (dummy weights), fills a decode batch, and times the
eager step (`runner.compute_step`, no CUDA graph) with PDL off and on, alternately:
  enqueue: the CPU time to issue the step's launches (no synchronisation inside),
  wall:    enqueue + wait for the GPU,
  gpu:     CUDA events around the step on the stream.
Medians of 20 steps after a warm-up (which compiles both kernel variants).

Usage: python benchmarks/bench_pdl_eager.py [--model qwen3-0.6b --batch 48 --context 1024]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_step import decode_shape, fill_decode  # noqa: E402

from slipstream.bench.workloads import CONFIGS  # noqa: E402
from slipstream.config import EngineConfig  # noqa: E402
from slipstream.core.engine_core import EngineCore  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    cfg = EngineConfig(model=os.path.join(CONFIGS, args.model), load_format="dummy", device="cuda",
                       max_num_seqs=args.batch, max_model_len=args.context + 64, enforce_eager=True,
                       enable_prefix_caching=False)
    runner = EngineCore(cfg).runner
    slot = runner.slots[0]
    fill_decode(runner, slot, args.batch, args.context)
    shape = decode_shape(runner, args.batch)
    print(f"{args.model} batch {args.batch} ctx {args.context}, eager step, median of 20 (ms)")
    print("| PDL | enqueue | wall | gpu |\n|---|---|---|---|")
    for flag in ["0", "1", "0", "1"]:
        os.environ["SLIPSTREAM_PDL"] = flag
        for _ in range(3):
            runner.compute_step(slot, shape)
        torch.cuda.synchronize()
        enq, wall, gpu = [], [], []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            runner.compute_step(slot, shape)
            b.record()
            t1 = time.perf_counter()
            b.synchronize()
            t2 = time.perf_counter()
            enq.append(t1 - t0)
            wall.append(t2 - t0)
            gpu.append(a.elapsed_time(b) / 1e3)
        print(f"| {'on' if flag == '1' else 'off'} | {1e3 * statistics.median(enq):.2f} | "
              f"{1e3 * statistics.median(wall):.2f} | {1e3 * statistics.median(gpu):.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
