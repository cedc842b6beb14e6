#!/usr/bin/env python
"""The one-row products' kernels for Nsight Compute: the 8B shape's gate_up (folded norm) and
down (SiLU·mul into the residual) at one row, each as the FP8 GEMV (`fp8_gemv`, the default
config), the bf16 GEMV (`gemv`, the engine's one-row bf16 path) and the FP8 weight read in the
FP8 GEMV's grid and tiles with nothing but a sum (probe_read_bandwidth.py's `tile_read`): the
first reads its bytes at ~0.7 of the copy rate, the other two at ~0.9-1.0, and the hardware
counters (DRAM throughput, L2 hits, warp stalls, occupancy) say what differs.

Every kernel runs once to compile, then once between cudaProfilerStart and Stop, so that

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        python benchmarks/ncu_one_row.py

profiles exactly the six launches (ncu flushes the caches before each by default). Without
ncu it times each launch with CUDA events (a first look, the caches not flushed). On a CPU
(the test), under TRITON_INTERPRET=1, it runs the same six calls at toy sizes and checks the
products against their references.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from probe_read_bandwidth import tile_read  # noqa: E402  (this folder)
from slipstream.ops.device import sm_count  # noqa: E402
from slipstream.ops.fp8_linear import fp8_linear_ref  # noqa: E402
from slipstream.ops.fused import silu_and_mul_ref  # noqa: E402
from slipstream.ops.triton_fp8_gemv import DEFAULT_FP8_GEMV_CONFIG, fp8_gemv  # noqa: E402
from slipstream.ops.triton_fp8_gemv_mma import mma_shape  # noqa: E402
from slipstream.ops.triton_gemv import gemv  # noqa: E402
from slipstream.quant.fp8 import Fp8Weight, quantize_per_channel  # noqa: E402

# (name, N, K, form): the 8B shape's two long one-row products; toy sizes on the CPU
SHAPES = {"cuda": [("gate_up", 28672, 4096, "norm"), ("down", 4096, 14336, "silu_mul")],
          "cpu": [("gate_up", 256, 128, "norm"), ("down", 128, 256, "silu_mul")]}


def launches(name: str, n: int, k: int, form: str, dev: torch.device) -> list[tuple[str, object, object]]:
    """(label, call, reference or None) for the three kernels on one shape."""
    gen = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).to(torch.bfloat16)
    q, s = quantize_per_channel(w)
    gamma = torch.rand(k, generator=gen, device=dev) + 0.5
    fw = Fp8Weight(q, s, None, gamma)
    wg = (w.float() * gamma).to(torch.bfloat16)  # the bf16 layer's folded norm
    kin = 2 * k if form == "silu_mul" else k
    x = torch.randn(1, kin, generator=gen, device=dev).to(torch.bfloat16)
    r = torch.randn(1, n, generator=gen, device=dev).to(torch.bfloat16)
    if form == "norm":
        fp8 = lambda: fp8_gemv(x, fw, row_scale_eps=1e-5)  # noqa: E731
        bf16 = lambda: gemv(x, wg, row_scale_eps=1e-5)  # noqa: E731
        ref = None
    else:
        fw = Fp8Weight(q, s)
        fp8 = lambda: fp8_gemv(x, fw, residual=r, silu_mul=True)  # noqa: E731
        bf16 = lambda: gemv(x, w, residual=r, silu_mul=True)  # noqa: E731
        ref = fp8_linear_ref(silu_and_mul_ref(x), fw).float() + r.float()
    words = q.view(torch.int32) if k % 4 == 0 else None
    block_k, stages = DEFAULT_FP8_GEMV_CONFIG.mma_tiles(1)
    sh = mma_shape(n, k, DEFAULT_FP8_GEMV_CONFIG.mma_block_n, block_k, DEFAULT_FP8_GEMV_CONFIG.mma_warps, None,
                   DEFAULT_FP8_GEMV_CONFIG.mma_split_k, sm_count(dev))
    total = torch.zeros(1, device=dev, dtype=torch.int32)
    read = lambda: tile_read(words, total, sh.block_n, block_k // 4, sh.split, stages,  # noqa: E731
                             DEFAULT_FP8_GEMV_CONFIG.mma_warps)
    return [(f"{name} fp8 gemv", fp8, ref), (f"{name} bf16 gemv", bf16, None), (f"{name} fp8 tile read", read, None)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("ncu_one_row: without a GPU, run it under TRITON_INTERPRET=1")
    calls = [c for name, n, k, form in SHAPES[dev.type] for c in launches(name, n, k, form, dev)]
    for label, call, ref in calls:  # compile (and check where a reference is at hand)
        y = call()
        if ref is not None:
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            if err > 2e-2:
                raise AssertionError(f"{label}: relative error {err:.2e}")
            print(f"{label}: max relative error {err:.1e}")
    if dev.type != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for label, call, _ in calls:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        print(f"{label}: {start.elapsed_time(end) * 1e3:.1f} us (one launch with its neighbours)")
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
