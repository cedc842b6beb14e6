#!/usr/bin/env python
"""How fast can a one-row step read its weights? The device's read-only bandwidth against
its copy bandwidth (the floor's unit), and the one-row GEMV (`ops/triton_gemv.py`) on each
8B-shape weight alone, as TB/s of weight bytes.

The floor of docs/benchmarks.md counts bytes at the measured copy bandwidth (read + written).
A GEMV only reads, and a read-only stream may run faster than a copy; if so, the one-row
8B step's GEMVs (1.04-1.05 x their bytes' time at copy bandwidth) have room left that the
floor hides, and this says which weight shape has it.

  read      a Triton kernel summing a 4 GiB bf16 tensor, each program striding over it
            in BLOCK-wide loads (grid = SMs x programs_per_sm), the best of a few shapes
  tiles     (--fp8-tiles) each 8B-shape weight as FP8 bytes read in the one-row FP8 GEMV's
            pattern (ops/triton_fp8_gemv_mma.py: a program owns block_n rows and walks its
            slice of K in block_k-wide tiles, `mma_shape`'s grid) with nothing but a sum:
            whether the tiles' shape or the kernel's work bounds that GEMV
  gemv      `gemv(x, w)` at one row, each weight shape alone: 8 distinct copies (more
            than L2) in turn in one CUDA graph, with PDL as the engine launches it; the
            median replay over the calls.  `--variant NAME:field=v,...` adds GemvConfig
            variants (stream_block_n, stream_block_k, stream_stages, stream_warps)

Usage: python benchmarks/probe_read_bandwidth.py [--variant NAME:k=v,...] [--copies 8]
On a CPU (the test) it runs the interpreter at toy sizes and checks the read kernel's sum.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_gemv import copy_bandwidth  # noqa: E402  (this folder)
from slipstream.bench.cuda_timing import time_graph  # noqa: E402
from slipstream.ops.device import sm_count  # noqa: E402
from slipstream.ops.triton_gemv import DEFAULT_GEMV_CONFIG, gemv  # noqa: E402

# the 8B shape's one-row products: (name, N, K)
WEIGHTS_8B = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
              ("down", 4096, 14336), ("lm_head", 128256, 4096)]


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Sum of x (fp32), each program taking every num_programs-th BLOCK-wide slice."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in tl.range(pid * BLOCK, n, step, num_stages=STAGES):
        acc += tl.load(x_ptr + start + offs, mask=start + offs < n, other=0.0).to(tl.float32)
    tl.atomic_add(out_ptr, tl.sum(acc, axis=0))


@triton.jit
def _tile_read_kernel(w_ptr, out_ptr, K, k_per_split, stride, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      STAGES: tl.constexpr):
    """Sum (int32, wrapping) of a program's [BLOCK_N, k_per_split] slice of w (int32 words:
    4 FP8 bytes each), in [BLOCK_N, BLOCK_K] tiles (the last one masked past K); N divides by
    BLOCK_N."""
    pid, split = tl.program_id(0), tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride + offs_k
    k0 = split * k_per_split
    acc = tl.zeros([BLOCK_N], tl.int32)
    for k in tl.range(k0, tl.minimum(k0 + k_per_split, K), BLOCK_K, num_stages=STAGES):
        acc += tl.sum(tl.load(ptrs + k, mask=offs_k + k < K, other=0), axis=1)
    tl.atomic_add(out_ptr, tl.sum(acc, axis=0))


def tile_read(w: torch.Tensor, out: torch.Tensor, block_n: int, block_k: int, split: int, stages: int,
              warps: int) -> None:
    """Read w [N, K] int32 in the GEMV's grid: N / block_n row blocks x `split` slices of K."""
    n, k = w.shape
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split) * block_k
    _tile_read_kernel[(n // block_n, triton.cdiv(k, k_per_split))](
        w, out, k, k_per_split, w.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, num_warps=warps)


# (block_n, K tile in bytes, stages, warps): the FP8 GEMV's default at one row first
TILE_SHAPES = [(128, 512, 2, 4), (128, 512, 3, 4), (128, 1024, 2, 4), (128, 1024, 2, 8), (64, 1024, 3, 4),
               (64, 2048, 2, 8), (32, 2048, 2, 8), (16, 4096, 2, 8), (128, 256, 3, 4)]


def tile_table(dev, copies: int, copy_best: float) -> None:
    """Each 8B weight (qkv, o, gate_up, down) read as FP8 bytes in TILE_SHAPES' tiles, the K
    split as the GEMV picks it (`mma_split`), `copies` copies in turn in one graph."""
    from slipstream.ops.triton_fp8_gemv_mma import mma_shape
    sms = sm_count(dev)
    out = torch.zeros(1, device=dev, dtype=torch.int32)
    print("| weight | MB | block_n x K tile, stages, warps | grid | us a call | TB/s | / copy |\n|---|---|---|---|---|---|---|")
    for name, n, k in WEIGHTS_8B[:4]:
        ws = [torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 4), device=dev, dtype=torch.int32)
              for _ in range(copies)]
        for block_n, block_k, stages, warps in TILE_SHAPES:
            sh = mma_shape(n, k, block_n, block_k, warps, None, None, sms)
            calls = [lambda w=w, sh=sh: tile_read(w, out, block_n, block_k // 4, sh.split, stages, warps)
                     for w in ws]
            us = time_graph(calls, iters=20, device=dev.type) * 1e3  # a call's (time_graph divides)
            tbps = n * k / (us * 1e-6) / 1e12
            print(f"| {name} | {n * k / 1e6:.1f} | {block_n} x {block_k}, {stages}, {warps} | "
                  f"{sh.row_blocks} x {sh.split} | {us:.2f} | {tbps:.2f} | {tbps / copy_best:.3f} |")
        del ws


def read_sum(x: torch.Tensor, out: torch.Tensor, programs: int, block: int, stages: int) -> None:
    _read_kernel[(programs,)](x, out, x.numel(), BLOCK=block, STAGES=stages, num_warps=4)


def read_table(dev, numel: int) -> float:
    """The best read-only rate over a few launch shapes (TB/s); prints each."""
    x = torch.randn(numel, device=dev, dtype=torch.bfloat16)
    out = torch.zeros(1, device=dev, dtype=torch.float32)
    sms = sm_count(dev)
    best = 0.0
    print("| read kernel | programs | TB/s |\n|---|---|---|")
    for per_sm, block, stages in [(1, 8192, 3), (2, 4096, 3), (2, 8192, 3), (4, 4096, 3), (4, 2048, 4),
                                  (8, 2048, 3), (2, 16384, 2)]:
        ms = time_graph([lambda: read_sum(x, out, sms * per_sm, block, stages)], iters=10,
                        device=dev.type)
        tbps = numel * 2 / (ms * 1e-3) / 1e12
        best = max(best, tbps)
        print(f"| block {block}, {stages} stages | {sms} x {per_sm} | {tbps:.2f} |")
    return best


def gemv_table(dev, variants: dict, copies: int, read_best: float, copy_best: float) -> None:
    print("| weight | MB | variant | us a call | TB/s | / read | / copy |\n|---|---|---|---|---|---|---|")
    gen = torch.Generator(device=dev).manual_seed(0)
    for name, n, k in WEIGHTS_8B:
        ws = [(torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).to(torch.bfloat16)
              for _ in range(copies if n * k * 2 * copies < (12 << 30) else 2)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        y = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        ref = (x.float() @ ws[0].float().t())
        mb = n * k * 2 / 1e6
        for vname, cfg in variants.items():
            err = ((gemv(x, ws[0], cfg=cfg).float() - ref).abs().max() / ref.abs().max()).item()
            if err > 1e-2:
                raise AssertionError(f"{name} {vname}: relative error {err:.2e}")
            calls = [lambda w=w: gemv(x, w, out=y, cfg=cfg) for w in ws] * max(1, 8 // len(ws))
            us = time_graph(calls, iters=20, device=dev.type) * 1e3
            tbps = n * k * 2 / (us * 1e-6) / 1e12
            print(f"| {name} | {mb:.1f} | {vname} | {us:.2f} | {tbps:.2f} | {tbps / read_best:.3f} | "
                  f"{tbps / copy_best:.3f} |")
        del ws


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME:field=value,... (GemvConfig fields, integers)")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--fp8-tiles", action="store_true", help="only the FP8 GEMV's tile pattern (tiles above)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type != "cuda":  # interpreter smoke check: the read kernel sums correctly
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("probe_read_bandwidth: without a GPU, run it under TRITON_INTERPRET=1")
        x = torch.randn(3000)
        out = torch.zeros(1)
        read_sum(x, out, programs=3, block=256, stages=1)
        assert abs(out.item() - x.sum().item()) < 1e-2 * max(1.0, x.abs().sum().item() ** 0.5), out
        print(f"read kernel sum ok: {out.item():.4f} vs {x.sum().item():.4f}")
        w = torch.randint(-1000, 1000, (64, 96), dtype=torch.int32)
        tot = torch.zeros(1, dtype=torch.int32)
        tile_read(w, tot, block_n=16, block_k=32, split=2, stages=1, warps=4)
        assert tot.item() == w.sum().item(), (tot, w.sum())
        print(f"tile read sum ok: {tot.item()}")
        return 0
    variants = {"default": DEFAULT_GEMV_CONFIG}
    for spec in args.variant:
        vname, _, body = spec.partition(":")
        kw = {key: int(v) for key, v in (item.split("=") for item in filter(None, body.split(",")))}
        variants[vname] = dataclasses.replace(DEFAULT_GEMV_CONFIG, **kw)
    copy_best = copy_bandwidth(dev) / 1e12
    print(f"{torch.cuda.get_device_name()}, {sm_count(dev)} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}; copy {copy_best:.2f} TB/s (read + written)")
    if args.fp8_tiles:
        tile_table(dev, args.copies, copy_best)
        return 0
    read_best = read_table(dev, 2 << 30)
    print(f"read-only best {read_best:.2f} TB/s = {read_best / copy_best:.3f} x copy")
    gemv_table(dev, variants, args.copies, read_best, copy_best)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
