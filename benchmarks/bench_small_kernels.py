#!/usr/bin/env python
"""The per-layer small kernels of a Qwen3-0.6B decode step (qkv epilogue with the folded
norm's row scale, SiLU·mul with it) at small-256's batch sizes, per launch shape.

    python benchmarks/bench_small_kernels.py [--out DIR]

Each variant runs as a chain of 28 calls (one per layer, separate buffers) in one CUDA
graph, median of replays (`slipstream.bench.cuda_timing`); µs per call. Outputs are checked
against the default launch.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from slipstream.bench.cuda_timing import time_graph  # noqa: E402
from slipstream.bench.report import write_json  # noqa: E402
from slipstream.ops.fused import build_cos_sin_cache  # noqa: E402
from slipstream.ops.triton_fused import silu_and_mul_triton  # noqa: E402
from slipstream.ops.triton_qkv_epilogue import qkv_epilogue_triton  # noqa: E402

HQ, HK, D, HIDDEN, INTER, LAYERS = 16, 8, 128, 1024, 3072, 28
ROWS = [16, 44, 101, 150, 211, 256]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    cs = build_cos_sin_cache(1.0 / 1e6 ** (torch.arange(0, D, 2, device=dev).float() / D), 4096)
    qw = torch.ones(D, device=dev, dtype=dt)
    rows_out = []
    print("| kernel | rows | variant | us/call |")
    print("|---|---|---|---|")
    for T in ROWS:
        hs = [torch.randn(T, HIDDEN, device=dev, dtype=dt, generator=g) for _ in range(LAYERS)]
        qkvs = [torch.randn(T, (HQ + 2 * HK) * D, device=dev, dtype=dt, generator=g) for _ in range(LAYERS)]
        caches = [(torch.zeros(T // 16 + 2, 16, HK, D, device=dev, dtype=dt),
                   torch.zeros(T // 16 + 2, 16, HK, D, device=dev, dtype=dt)) for _ in range(LAYERS)]
        pos = torch.randint(0, 4000, (T,), device=dev, dtype=torch.int32)
        slots = torch.arange(T, device=dev, dtype=torch.int32)
        for bh, warps in ((None, None), (2, None), (8, None), (16, None), (4, 2), (8, 4), (16, 4), (16, 8)):
            calls = [lambda i=i, bh=bh, warps=warps: qkv_epilogue_triton(
                qkvs[i], pos, cs, caches[i][0], caches[i][1], slots, HQ, HK, D, qw, qw, 1e-6,
                hidden=hs[i], block_h=bh, num_warps=warps) for i in range(LAYERS)]
            us = 1e3 * time_graph(calls)
            label = f"block_h {bh or 'auto'}, {warps or 'auto'} warps"
            print(f"| epilogue | {T} | {label} | {us:.2f} |")
            rows_out.append(dict(kernel="epilogue", rows=T, variant=label, us=us))
        gus = [torch.randn(T, 2 * INTER, device=dev, dtype=dt, generator=g) for _ in range(LAYERS)]
        ref = silu_and_mul_triton(gus[0], hidden=hs[0])
        for block, warps in ((None, None), (512, 2), (512, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8)):
            got = silu_and_mul_triton(gus[0], hidden=hs[0], block=block, num_warps=warps)
            # (the row statistic's sum order follows the warp count: one bf16 step apart at most)
            torch.testing.assert_close(got, ref, atol=2e-2, rtol=1.6e-2)
            calls = [lambda i=i, block=block, warps=warps: silu_and_mul_triton(
                gus[i], hidden=hs[i], block=block, num_warps=warps) for i in range(LAYERS)]
            us = 1e3 * time_graph(calls)
            label = f"block {block or 'auto'}, {warps or 'auto'} warps"
            print(f"| silu_mul | {T} | {label} | {us:.2f} |")
            rows_out.append(dict(kernel="silu_mul", rows=T, variant=label, us=us))
    if args.out:
        write_json(args.out, "bench_small_kernels.json", rows_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
