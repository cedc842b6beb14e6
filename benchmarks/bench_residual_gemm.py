#!/usr/bin/env python
"""The residual add inside the GEMM (`linear_add_`: cuBLAS with beta = 1) against a plain GEMM
and against a GEMM + a separate add, on the o_proj / down_proj shapes of Qwen3-0.6B and
Llama-3.1-8B, per batch size.

    python benchmarks/bench_residual_gemm.py [--out DIR]

Variants (each call timed in one CUDA graph over 3 rotating weight copies, median of
replays, `slipstream.bench.cuda_timing`):
  linear      y = x W^T (F.linear, beta = 0): what the layer ran before the folded norms
  addmm       h += x W^T in place (torch addmm_, cuBLAS beta = 1): `linear_add_`
  linear+add  h += F.linear(x, W) (two kernels)
  addmm-lt    addmm with torch's BLAS preference set to cuBLASLt
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from slipstream.bench.cuda_timing import time_graph  # noqa: E402
from slipstream.bench.report import write_json  # noqa: E402

SHAPES = [("0.6b", "o", 1024, 2048), ("0.6b", "down", 1024, 3072),
          ("8b", "o", 4096, 4096), ("8b", "down", 4096, 14336)]
BATCHES = [8, 16, 32, 48, 64, 96, 128, 160, 211, 256, 2048, 8192]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    rows = []
    print("| model | gemm | M | linear us | addmm us | linear+add us | addmm-lt us | addmm / linear |")
    print("|---|---|---|---|---|---|---|---|")
    for model, name, N, K in SHAPES:
        ws = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(3)]
        for M in BATCHES:
            if model == "8b" and M in (8, 96, 160, 211):
                continue
            x = torch.randn(M, K, device=dev, dtype=dt)
            h = torch.randn(M, N, device=dev, dtype=dt)
            ref = h.float() + x.float() @ ws[0].float().t()
            got = h.clone().addmm_(x, ws[0].t())
            err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-2, err
            t = {}
            t["linear"] = time_graph([lambda w=w: F.linear(x, w) for w in ws])
            t["addmm"] = time_graph([lambda w=w: h.addmm_(x, w.t()) for w in ws])
            t["linear+add"] = time_graph([lambda w=w: h.add_(F.linear(x, w)) for w in ws])
            prev = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library("cublaslt")
            try:
                t["addmm-lt"] = time_graph([lambda w=w: h.addmm_(x, w.t()) for w in ws])
            finally:
                torch.backends.cuda.preferred_blas_library(prev)
            us = {k: 1e3 * v for k, v in t.items()}
            print(f"| {model} | {name} | {M} | {us['linear']:.1f} | {us['addmm']:.1f} | "
                  f"{us['linear+add']:.1f} | {us['addmm-lt']:.1f} | {us['addmm'] / us['linear']:.2f} |")
            rows.append(dict(model=model, gemm=name, M=M, **us))
    if args.out:
        write_json(args.out, "bench_residual_gemm.json", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
