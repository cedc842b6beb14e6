#!/usr/bin/env python
"""The skinny FP8 GEMM's configs (`Fp8SkinnyConfig`, ops/triton_fp8_gemm_skinny.py) on every
linear of the 8B shape at 32-256 rows, against `torch._scaled_mm` and bf16 cuBLAS: each
variant's time against the floor of the FP8 weight's bytes at 3.0 TB/s
(benchmarks/weight_floor.py), then the fastest per (shape, rows) as a table to paste.

    python benchmarks/bench_fp8_skinny.py [--rows 32,64,128,256] [--shapes qkv,o,gate_up,down,lm_head]
        [--variants NAME:field=v,... ...] [--no-default-variants] [--groups 64,128] [--jobs N] [--floor-tbs 3.0]
        [--out DIR] [--tiny]

Per-channel weights (what `--quantization fp8` makes), qkv and gate_up with a folded norm's
gamma as the engine's. Implementations, each a whole call
(the input's per-token quantization included, as the engine runs it):

    bf16          ops.linear.linear (cuBLAS at these rows)
    mm, mm-fast   per-token quantization + torch._scaled_mm row-wise, fast accumulation off / on
    fp8           ops.fp8_linear.fp8_linear: what the routing table picks (ops/fp8_dispatch.py;
                  the weight-only GEMV at one row, checked against the weight-only reference)
    skinny        the skinny kernel with `skinny_config_for`'s tile for the rows
    skinny-*      one `Fp8SkinnyConfig` field moved from that tile (activation rows a
                  program, weight rows a program, K step, stages, warps, K split, the L2
                  prefetch), timed where it launches something new
    skinny-gG     (--groups G,...) the skinny kernel with the input quantized per token and
                  G-column group and each step's dot scaled by its group's scales (the block
                  weights' loop, the per-channel scale repeated as a 1 x G block): what a
                  producer that quantizes its own output tiles would hand the product (a
                  G-column tile of the GEMM before, a head of attention), priced here with
                  the per-group quantization launch in its time as the default has its own

The weights rotate over copies of at least 100 MB of FP8 (the bf16 baseline reads twice
that), so that every product reads its weight from memory, not L2. Each implementation is
first checked against its reference on one copy (weight-only or activation-quantized, as it
computes; relative RMS error <= 2^-6: the same FP8 operands; a failure is printed and the
sweep goes on). --jobs worker
processes compile every launch first (benchmarks/precompile.py). `--tiny`: small shapes on
the CPU under Triton's interpreter, a smoke test.
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

from bench_fp8_gemm import rel_rms  # noqa: E402
from precompile import precompile  # noqa: E402
from weight_floor import FLOOR_TBS, best_table, floor_us  # noqa: E402

from slipstream.bench.cuda_timing import time_graph  # noqa: E402
from slipstream.bench.report import write_json  # noqa: E402
from slipstream.ops.fp8_dispatch import fp8_product  # noqa: E402
from slipstream.ops.fp8_linear import fp8_linear, fp8_linear_ref, multiplies_unquantized  # noqa: E402
from slipstream.ops.linear import linear  # noqa: E402
from slipstream.ops.triton_fp8_gemm_skinny import Fp8SkinnyConfig, fp8_gemm_skinny, skinny_config_for  # noqa: E402
from slipstream.quant.fp8 import Fp8Weight, quantize_per_channel  # noqa: E402
from slipstream.utils.overrides import parse_overrides  # noqa: E402

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
             "lm_head": (128256, 4096)}
SHAPES_TINY = {"qkv": (96, 256), "down": (64, 512)}
BASELINES = ["bf16", "mm", "mm-fast", "fp8"]
# each a field moved from skinny_config_for's tile for the rows (benchmarks' names: skinny-...)
DEFAULT_VARIANTS = [
    "bm16:block_m=16", "bm32:block_m=32", "bm64:block_m=64", "bm128:block_m=128", "bn128:block_n=128",
    "bk256:block_k=256", "s3:num_stages=3", "s4:num_stages=4", "s6:num_stages=6", "w8:num_warps=8",
    "split1:split_k=1", "split2:split_k=2", "split4:split_k=4", "nopf:prefetch_k=0", "pf2048:prefetch_k=2048",
]
GAMMA_SHAPES = ("qkv", "gate_up")  # the engine folds the norm before them into the product
COPY_BYTES = 100e6


def parse_variant(spec: str) -> tuple[str, dict]:
    name, _, body = spec.partition(":")
    return f"skinny-{name}", parse_overrides(Fp8SkinnyConfig, body)


def call(impl: str, x: torch.Tensor, w: Fp8Weight, wb: torch.Tensor, cfg: Fp8SkinnyConfig | None):
    if impl == "bf16":
        return lambda: linear(x, wb)
    if impl in ("mm", "mm-fast"):
        kernel = "scaled_mm" if impl == "mm" else "scaled_mm_fast"
        return lambda: fp8_product(x, w, None, kernel)
    if impl == "fp8":
        return lambda: fp8_linear(x, w)
    if impl.startswith("skinny-g"):
        wg = grouped(w, int(impl.removeprefix("skinny-g")))
        return lambda: fp8_gemm_skinny(x, wg, None, cfg)
    return lambda: fp8_gemm_skinny(x, w, None, cfg)


def grouped(w: Fp8Weight, group: int) -> Fp8Weight:
    """A per-channel weight as 1 x `group` blocks (its scale repeated along K): the same
    products, taken by the skinny kernel's block loop with per-group input scales."""
    n, k = w.shape
    scale = w.scale.reshape(n, 1).expand(n, -(-k // group)).contiguous()
    return Fp8Weight(w.qweight, scale, (1, group), w.gamma)


def make_weights(n: int, k: int, copies: int, dev: str, gen, gamma: bool = False) -> list[tuple[Fp8Weight, torch.Tensor]]:
    out = []
    for _ in range(copies):
        wb = (torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).to(torch.bfloat16)
        g = torch.rand(k, generator=gen, device=dev) + 0.5 if gamma else None
        out.append((Fp8Weight(*quantize_per_channel(wb), gamma=g), wb))
    return out


def _compile_tasks(tasks: list[tuple], shapes: dict, dev: str) -> int:
    """A worker's share (name, m, impl, cfg): each launched once into Triton's on-disk cache."""
    gen = torch.Generator(device=dev).manual_seed(0)
    made: dict = {}
    for name, m, impl, cfg in tasks:
        n, k = shapes[name]
        if name not in made:
            made[name] = make_weights(n, k, 1, dev, gen, name in GAMMA_SHAPES)[0]
        w, wb = made[name]
        x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
        try:
            call(impl, x, w, wb, cfg)()
        except Exception:  # noqa: BLE001,S110 -- the timing process reports it
            pass
    if dev == "cuda":
        torch.cuda.synchronize()
    return len(tasks)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=None, help="default 32,64,128,256 (--tiny: 20,40)")
    ap.add_argument("--shapes", default=None)
    ap.add_argument("--variants", nargs="*", default=[])
    ap.add_argument("--no-default-variants", action="store_true")
    ap.add_argument("--groups", default="", help="e.g. 64,128: the skinny-gG implementations")
    jobs = 0 if "--tiny" in sys.argv else max(1, min(14, (os.cpu_count() or 1) - 2))
    ap.add_argument("--jobs", type=int, default=jobs)
    ap.add_argument("--floor-tbs", type=float, default=FLOOR_TBS)
    ap.add_argument("--out")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    dev = "cpu" if args.tiny else "cuda"
    shapes = SHAPES_TINY if args.tiny else SHAPES_8B
    if args.shapes:
        shapes = {name: shapes[name] for name in args.shapes.split(",")}
    rows = [int(v) for v in (args.rows or ("20,40" if args.tiny else "32,64,128,256")).split(",")]
    variants = [parse_variant(v) for v in ([] if args.no_default_variants else DEFAULT_VARIANTS) + args.variants]
    if dev == "cuda":
        import triton
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
              f"floor at {args.floor_tbs:.1f} TB/s")
    plan = []  # (shape, rows, impl, skinny config or None)
    for name, (n, k) in shapes.items():
        for m in rows:
            base = skinny_config_for(m, n, k)
            plan += [(name, m, impl, None) for impl in BASELINES] + [(name, m, "skinny", base)]
            for g in filter(None, args.groups.split(",")):
                plan.append((name, m, f"skinny-g{int(g)}", skinny_config_for(m, n, k)))
            seen = {base}
            for impl, kw in variants:
                cfg = dataclasses.replace(base, **kw)
                if cfg not in seen:
                    seen.add(cfg)
                    plan.append((name, m, impl, cfg))
    if args.jobs > 0:
        precompile(_compile_tasks, plan, args.jobs, shapes, dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    results = []
    print("| shape | M | impl | us | x floor | TFLOP/s | rel RMS err |")
    print("|---|---|---|---|---|---|---|")
    for name, (n, k) in shapes.items():
        copies = 1 if args.tiny else max(1, -(-int(COPY_BYTES) // (n * k)))
        weights = make_weights(n, k, copies, dev, gen, name in GAMMA_SHAPES)
        fl = floor_us(weights[0][0].nbytes(), args.floor_tbs)
        for m in rows:
            x = torch.randn(m, k, generator=gen, device=dev)
            x[:, ::97] *= 20  # a few outlier channels, as real activations have
            x = x.to(torch.bfloat16)
            quantized = fp8_linear_ref(x.float(), weights[0][0], quantize_input=True).double()
            # the one-row GEMV's (and the CPU's) weight-only reference, for the routed path only
            unquantized = fp8_linear_ref(x.float(), weights[0][0]).double() if multiplies_unquantized(x) else None
            for _, _, impl, cfg in [p for p in plan if p[0] == name and p[1] == m]:
                try:  # a variant that fails (compile, launch, bound) is reported, not fatal
                    y = call(impl, x, *weights[0], cfg)().double()
                    r = unquantized if impl == "fp8" and unquantized is not None else quantized
                    if impl.startswith("skinny-g"):  # its input is quantized per group
                        wg = grouped(weights[0][0], int(impl.removeprefix("skinny-g")))
                        r = fp8_linear_ref(x.float(), wg, quantize_input=True).double()
                    err = rel_rms(y, r)
                    # (bf16 reads its own weight, not the FP8 one)
                    if impl != "bf16" and not err <= 2 ** -6:
                        raise AssertionError(f"relative RMS error {err:.2e} over 2^-6")
                    us = time_graph([call(impl, x, w, wb, cfg) for w, wb in weights], device=dev) * 1e3
                except Exception as e:  # noqa: BLE001
                    results.append({"shape": name, "m": m, "impl": impl, "failed": repr(e)[:300]})
                    print(f"| {name} | {m} | {impl} | FAILED: {repr(e)[:200]} ||||", flush=True)
                    continue
                results.append({"shape": name, "n": n, "k": k, "m": m, "impl": impl, "us": us, "floor_us": fl,
                                "tflops": 2 * m * n * k / us / 1e6, "rel_rms_err": err,
                                "config": dataclasses.asdict(cfg) if cfg is not None else None})
                print(f"| {name} | {m} | {impl} | {us:.2f} | {us / fl:.2f} | {2 * m * n * k / us / 1e6:.1f} | "
                      f"{err:.1e} |", flush=True)
        del weights
        if dev == "cuda":
            torch.cuda.empty_cache()
    print("\nfastest skinny variant per shape and row count (bf16 and mm read the same weight: bf16 twice the bytes)")
    print(best_table(results, "skinny", BASELINES, args.floor_tbs))
    if args.out:
        meta = {"torch": torch.__version__, "floor_tbs": args.floor_tbs,
                "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu"}
        print("wrote", write_json(args.out, "bench_fp8_skinny.json", {"meta": meta, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
