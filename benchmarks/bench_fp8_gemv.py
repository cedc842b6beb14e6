#!/usr/bin/env python
"""The small-batch FP8 GEMV's configs (`Fp8GemvConfig`, ops/triton_fp8_gemv.py) on every
linear of the 8B shape at 1-16 rows, with the bf16 product beside it: each variant's time
against the floor of the FP8 weight's bytes at 3.0 TB/s (benchmarks/weight_floor.py), then
the fastest variant per (shape, rows) as a table to paste, so that one GPU call times every
MMA tile, K tile, stage count and K split and the lead picks the defaults.

    python benchmarks/bench_fp8_gemv.py [--rows 1,2,4,8,16] [--variant-rows 1,2,4,8,16]
        [--shapes qkv,o,gate_up,down,lm_head] [--variants NAME:field=v,... ...]
        [--no-default-variants] [--jobs N] [--floor-tbs 3.0] [--out DIR] [--tiny]

Each product runs in the form the model's small-batch layer takes: qkv and gate_up with the
folded norm (gamma and the row scale), o into the residual, down from [gate | up] with
SiLU·mul into the residual, the LM head plain. Per (shape, rows, implementation) one CUDA
graph runs the product over enough distinct weight copies to stream more than L2 (50 MB);
the median of 20 replays, divided by the copies, is reported. Implementations: `bf16` (the
engine's bf16 path, `ops.linear`) and `fp8` (the default config) at every row count of
--rows, then every FP8 variant at those of --variant-rows, skipped where it launches what
another already did (the same tiles, split, stages and row padding). Each (variant, rows,
shape) compiles its own kernel, ~300 in all: --jobs worker processes compile them first (one
launch each, into Triton's on-disk cache, which the timing process then reads): on an H100
host's 16 cores `--rows 1,4,16 --variant-rows 1,4` took 24 s. Each variant is
first checked against the weight-only reference on one copy (a failure is printed and the
sweep goes on; `--variants` adds
`Fp8GemvConfig` overrides: mma_block_n, mma_block_k, mma_stages, mma_warps, mma_split_k,
mma_min_m_pad).
GB/s counts the bytes the product reads of its weight (FP8 values, scales, gamma; bf16: the
weight); `x floor` is the time over the FP8 weight's floor for every implementation (bf16's
own floor is twice it). Where qkv, o, gate_up and down all ran at one row, a last table sums
them per implementation: the layer's weight bytes over its summed times, against the copy
bandwidth. `--tiny`: small shapes on the CPU under Triton's interpreter, a smoke test
(`--tiny --shapes qkv,o,gate_up,down` for the layer table).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

if "--tiny" in sys.argv:  # before Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import triton  # noqa: E402
from precompile import precompile  # noqa: E402
from weight_floor import FLOOR_TBS, best_table, floor_us  # noqa: E402

from slipstream.bench.cuda_timing import time_graph  # noqa: E402
from slipstream.bench.report import write_json  # noqa: E402
from slipstream.ops.device import sm_count  # noqa: E402
from slipstream.ops.fp8_linear import fp8_linear_ref  # noqa: E402
from slipstream.ops.fused import scale_rows_ref, silu_and_mul_ref  # noqa: E402
from slipstream.ops.triton_fp8_gemv import Fp8GemvConfig, fp8_gemv  # noqa: E402
from slipstream.ops.triton_fp8_gemv_mma import mma_shape  # noqa: E402
from slipstream.quant.fp8 import Fp8Weight, quantize_per_channel  # noqa: E402
from slipstream.utils.overrides import parse_variant  # noqa: E402

# name -> (N, K, form)
SHAPES_8B = {"qkv": (6144, 4096, "norm"), "o": (4096, 4096, "residual"), "gate_up": (28672, 4096, "norm"),
             "down": (4096, 14336, "silu_mul"), "lm_head": (128256, 4096, "plain")}
SHAPES_TINY = {"qkv": (48, 160, "norm"), "down": (32, 96, "silu_mul")}
SHAPES_TINY_LAYER = {**SHAPES_TINY, "o": (32, 96, "residual"), "gate_up": (64, 128, "norm")}  # --tiny --shapes
# the variants timed unless --no-default-variants: each MMA field moved a step from the
# default (weight rows a program, the K tile, stages, warps, the K split, the row padding), at
# every row count where it launches something new
DEFAULT_VARIANTS = [
    "mma-n64:mma_block_n=64", "mma-n256:mma_block_n=256,mma_stages=2", "mma-k128:mma_block_k=128",
    "mma-k256:mma_block_k=256,mma_stages=3", "mma-s2:mma_stages=2", "mma-s3:mma_stages=3", "mma-s4:mma_stages=4",
    "mma-w8:mma_warps=8", "mma-split1:mma_split_k=1", "mma-split2:mma_split_k=2",
    "mma-split4:mma_split_k=4", "mma-split8:mma_split_k=8", "mma-pad8:mma_min_m_pad=8",
]
LAYER = ("qkv", "o", "gate_up", "down")
L2_BYTES = 50 << 20


def layer_table(impls: list[str], rows: list[dict], same_as: dict, copy_bw: float) -> str:
    """Per implementation at one row, the layer's four products together: their weight bytes
    over their summed times, against the copy bandwidth."""
    timed = {(r["shape"], r["m"], r["impl"]): r for r in rows if "us" in r}
    out = ["", "one row, the layer (qkv + o + gate_up + down) per implementation",
           "| impl | " + " | ".join(f"{s} us" for s in LAYER) + " | layer us | TB/s | x copy bw |",
           "|---|" + "---|" * (len(LAYER) + 3)]
    for impl in ["fp8"] + [i for i in impls if i != "fp8"]:
        got = [timed.get((s, 1, same_as.get((s, 1, impl), impl))) for s in LAYER]
        if any(r is None for r in got):
            continue
        us = sum(r["us"] for r in got)
        nbytes = sum(r["weight_gbs"] * 1e9 * r["us"] * 1e-6 for r in got)
        tbs = nbytes / (us * 1e-6) / 1e12
        out.append(f"| {impl} | " + " | ".join(f"{r['us']:.1f}" for r in got)
                   + f" | {us:.1f} | {tbs:.2f} | {tbs * 1e12 / copy_bw:.2f} |")
    return "\n".join(out)


def launched(cfg: Fp8GemvConfig, n: int, k: int, m: int, sms: int) -> tuple:
    """What `fp8_gemv` launches for this config at m rows of an [n, k] per-channel weight: two
    configs with the same key run the same kernel, so only the first is timed."""
    block_k, stages = cfg.mma_tiles(m)
    sh = mma_shape(n, k, cfg.mma_block_n, block_k, cfg.mma_warps, None, cfg.mma_split_k, sms)
    m_pad = max(triton.next_power_of_2(m), cfg.mma_min_m_pad)
    return ("mma", sh, stages, cfg.mma_warps, m_pad)


def make_weights(n: int, k: int, copies: int, dev, gen) -> list[tuple[torch.Tensor, Fp8Weight]]:
    """(bf16 weight, FP8 weight with a gamma) copies, per-channel scales."""
    out = []
    for _ in range(copies):
        w = (torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).to(torch.bfloat16)
        q, s = quantize_per_channel(w)
        out.append((w, Fp8Weight(q, s, None, torch.rand(k, generator=gen, device=dev) + 0.5)))
    return out


def fp8_call(form: str, x, r, w: Fp8Weight, cfg: Fp8GemvConfig):
    if form == "norm":
        return lambda: fp8_gemv(x, w, row_scale_eps=1e-5, cfg=cfg)
    if form == "silu_mul":
        return lambda: fp8_gemv(x, w, residual=r, out=r, silu_mul=True, cfg=cfg)
    if form == "residual":
        return lambda: fp8_gemv(x, w, residual=r, out=r, cfg=cfg)
    plain = Fp8Weight(w.qweight, w.scale)
    return lambda: fp8_gemv(x, plain, cfg=cfg)


def bf16_call(form: str, x, r, w: torch.Tensor):
    from slipstream.ops.linear import (
        linear,
        linear_add_,
        norm_linear,
        silu_mul_linear_add_,
    )
    if form == "norm":
        return lambda: norm_linear(x, w, None, 1e-5)
    if form == "silu_mul":
        return lambda: silu_mul_linear_add_(r, x, w)
    if form == "residual":
        return lambda: linear_add_(r, x, w)
    return lambda: linear(x, w)


def check(form: str, x, r, w: Fp8Weight, cfg: Fp8GemvConfig) -> float:
    """Relative max error of the variant against the weight-only reference (one copy), through
    the launch the timing makes (a zero residual where it adds one: the same kernel)."""
    y = fp8_call(form, x, torch.zeros_like(r), w, cfg)()
    if form == "norm":
        ref = scale_rows_ref(fp8_linear_ref(x.float(), w), x.float(), 1e-5, None)
    elif form == "silu_mul":
        ref = fp8_linear_ref(silu_and_mul_ref(x).float(), w)
    else:
        ref = fp8_linear_ref(x.float(), w if form == "residual" else Fp8Weight(w.qweight, w.scale))
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def _compile_tasks(tasks: list[tuple], shapes: dict, dev: str) -> int:
    """A worker's share of the sweep's launches (name, m, impl, cfg or None for bf16): each run
    once, so that its kernels are compiled into Triton's on-disk cache (benchmarks/precompile.py).
    Returns the count."""
    gen = torch.Generator(device=dev).manual_seed(0)
    made: dict = {}
    for name, m, _impl, cfg in tasks:
        n, k, form = shapes[name]
        if name not in made:
            made[name] = make_weights(n, k, 1, dev, gen)[0]
        w, fw = made[name]
        width = 2 * k if form == "silu_mul" else k
        x = (torch.randn(m, width, generator=gen, device=dev) * 2).to(torch.bfloat16)
        r = torch.randn(m, n, generator=gen, device=dev).to(torch.bfloat16)
        try:
            (bf16_call(form, x, r, w) if cfg is None else fp8_call(form, x, r, fw, cfg))()
        except Exception:  # noqa: BLE001 -- the timing process reports it
            pass
    if dev == "cuda":
        torch.cuda.synchronize()
    return len(tasks)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--variant-rows", default="1,2,4,8,16")
    ap.add_argument("--shapes", default=None)
    ap.add_argument("--variants", nargs="*", default=[])
    ap.add_argument("--no-default-variants", action="store_true")
    jobs = 0 if "--tiny" in sys.argv else max(1, min(14, (os.cpu_count() or 1) - 2))
    ap.add_argument("--jobs", type=int, default=jobs,
                    help="processes compiling the launches first (0: each compiles when first timed)")
    ap.add_argument("--floor-tbs", type=float, default=FLOOR_TBS)
    ap.add_argument("--out")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    dev = "cpu" if args.tiny else "cuda"
    shapes = SHAPES_TINY if args.tiny else SHAPES_8B
    if args.shapes:
        shapes = {name: (SHAPES_TINY_LAYER if args.tiny else SHAPES_8B)[name] for name in args.shapes.split(",")}
    impls = [("fp8", Fp8GemvConfig())]
    impls += [parse_variant(v, Fp8GemvConfig) for v in ([] if args.no_default_variants else DEFAULT_VARIANTS)
              + args.variants]
    if args.tiny:
        bw = 1e9  # no copy bandwidth on the CPU: the column is GB/s / 1
    else:
        from bench_gemv import copy_bandwidth
        bw = copy_bandwidth(torch.device(dev))
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
              f"copy {bw / 1e12:.2f} TB/s; floor at {args.floor_tbs:.1f} TB/s")
    sms = sm_count(torch.device(dev))
    variant_rows = {int(v) for v in args.variant_rows.split(",")}
    # what runs: per (shape, rows) bf16, the default, and each variant that launches something new
    plan, same_as = [], {}  # same_as: (shape, rows, impl) -> the impl timed for its launch
    for name, (n, k, _form) in shapes.items():
        for m in (int(v) for v in args.rows.split(",")):
            seen = {launched(impls[0][1], n, k, m, sms): "fp8"}
            plan.append((name, m, "bf16", None))
            plan.append((name, m, "fp8", impls[0][1]))
            for impl, cfg in impls[1:]:
                key = launched(cfg, n, k, m, sms)
                if m in variant_rows and key not in seen:
                    seen[key] = impl
                    plan.append((name, m, impl, cfg))
                elif m in variant_rows:
                    same_as[(name, m, impl)] = seen[key]
    if args.jobs > 0:  # (on the CPU, a smoke test of the plumbing: the interpreter caches nothing)
        precompile(_compile_tasks, plan, args.jobs, shapes, dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    print("| shape | M | impl | us | x floor | GB/s | x copy bw | max rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (n, k, form) in shapes.items():
        copies = 1 if args.tiny else max(1, -(-2 * L2_BYTES // (n * k)))
        weights = make_weights(n, k, copies, dev, gen)
        width = 2 * k if form == "silu_mul" else k
        fp8_bytes = weights[0][1].nbytes() - (0 if form != "plain" else k * 4)
        for m in dict.fromkeys(m for s, m, _, _ in plan if s == name):
            x = (torch.randn(m, width, generator=gen, device=dev) * 2).to(torch.bfloat16)
            r = torch.randn(m, n, generator=gen, device=dev).to(torch.bfloat16)
            for _, _, impl, cfg in [p for p in plan if p[0] == name and p[1] == m]:
                if cfg is None:
                    calls = [bf16_call(form, x, r, w) for w, _ in weights]
                    nbytes, err = weights[0][0].numel() * 2, None
                else:
                    try:  # a variant that fails (compile, bound) is reported and skipped, not fatal
                        err = check(form, x, r, weights[0][1], cfg)
                        if err > 2e-2:
                            raise AssertionError(f"relative error {err:.2e} over 2e-2")
                    except Exception as e:  # noqa: BLE001
                        rows_out.append(dict(shape=name, m=m, impl=impl, failed=repr(e)[:300]))
                        print(f"| {name} | {m} | {impl} | FAILED: {repr(e)[:200]} |||||", flush=True)
                        continue
                    calls = [fp8_call(form, x, r, fw, cfg) for _, fw in weights]
                    nbytes = fp8_bytes
                us = time_graph(calls, device=dev) * 1e3
                gbs = nbytes / (us * 1e-6) / 1e9
                row = dict(shape=name, n=n, k=k, form=form, m=m, impl=impl, us=us, weight_gbs=gbs,
                           floor_us=floor_us(fp8_bytes, args.floor_tbs), x_copy_bw=gbs * 1e9 / bw,
                           max_rel_err=err, config=dataclasses.asdict(cfg) if cfg is not None else None)
                rows_out.append(row)
                print(f"| {name} | {m} | {impl} | {us:.2f} | {us / row['floor_us']:.2f} | {gbs:.0f} | "
                      f"{row['x_copy_bw']:.2f} | {'' if err is None else f'{err:.1e}'} |", flush=True)
        del weights
        if dev == "cuda":
            torch.cuda.empty_cache()
    print("\nfastest FP8 GEMV variant per shape and row count (variants: this file's DEFAULT_VARIANTS)")
    print(best_table(rows_out, "fp8", ["bf16"], args.floor_tbs))
    if all(name in shapes for name in LAYER):
        print(layer_table([name for name, _ in impls], rows_out, same_as, bw))
    if args.out:
        meta = dict(torch=torch.__version__, triton=triton.__version__, floor_tbs=args.floor_tbs,
                    device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", copy_bw=bw)
        print("wrote", write_json(args.out, "bench_fp8_gemv.json", dict(meta=meta, rows=rows_out), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
