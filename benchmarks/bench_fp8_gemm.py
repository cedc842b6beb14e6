#!/usr/bin/env python
"""FP8 against bf16 linears, by rows: every FP8 kernel the routing table can pick
(ops/fp8_dispatch.py) and a few candidates, each timed as a whole call (the activation's
quantization included), its TFLOP/s and its speed against bf16 (`x`).

    python benchmarks/bench_fp8_gemm.py [--out DIR] [--rows 8,16,...] [--variants a,b,...] [--tiny]

Shapes: the Llama-3.1-8B layer's qkv, o, gate_up, down and its LM head (at most 2048 rows:
the engine runs the head on sampled rows only), and Qwen3-0.6B's at 256 rows. Variants
(`--variants` picks; default all):

    bf16           ops.linear.linear (cuBLAS; the bf16 GEMV at one row)
    fp8 / fp8-block   ops.fp8_linear.fp8_linear as the engine runs it (the GEMV at 1-16 rows,
                   then the routing table), per-channel / 128x128-block weights
    mm, mm-fast    per-token quantization + _scaled_mm row-wise, use_fast_accum off / on
    mm-tensor[-fast]  per-tensor weight and activation scales (ops/triton_fp8_quant_tensor.py:
                   an amax kernel, then the quantization) + _scaled_mm tensor-wise
    skinny, skinny-block   ops/triton_fp8_gemm_skinny.py (<= 256 rows; its tile for the rows)
    skinny[-block]-m128    the same with 128 activation rows a program (128-256 rows)
    skinny-nopf, skinny-s1 `skinny` without its weight prefetch before the PDL wait / K split
    triton         ops/triton_fp8_gemm.py, per-channel weights (the batch-invariant kernel)
    tb-mMnNwWsS[p] ops/triton_fp8_gemm.py on block weights with BLOCK_M x BLOCK_N tiles, W warps,
                   S stages, p: persistent (tb-m64n128w4s3 is the default config); the routing
                   table takes these names too
    mm-block       torch's block-scaled _scaled_mm (1x128 input groups, 128x128 weight blocks);
                   reported once as unsupported where this torch / cuBLASLt lacks it
    mm-block-v2    the same through torch.nn.functional.scaled_mm (BlockWise1x128 x BlockWise128x128)

Weights rotate over 3 or more copies (at least 150 MB of bf16, three H100 L2s) so that
small-row products read them from memory, as in a model's forward. Each variant's first 64
output rows are checked against the exact product (float64, unquantized operands): relative
RMS error <= 0.1 (e4m3 rounds each operand to within 2^-4), else it is reported WRONG and
not timed. After the tables: the fastest routable kernel per row count summed over the 8B
layer's four products, as a `SLIPSTREAM_FP8_ROUTES` string, and the error of fast
accumulation against the exact product of the same FP8 operands.
`--tiny`: small shapes on the CPU (Triton's interpreter), a smoke test of this script.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import replace
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from helpers import rel_rms  # noqa: E402  (tests/helpers.py: the tests' error measure)
from slipstream.bench.cuda_timing import time_graph  # noqa: E402
from slipstream.bench.report import write_json  # noqa: E402
from slipstream.ops.fp8_dispatch import fp8_product  # noqa: E402
from slipstream.ops.fp8_linear import fp8_linear  # noqa: E402
from slipstream.ops.linear import linear  # noqa: E402
from slipstream.ops.triton_fp8_gemm import DEFAULT_FP8_GEMM_CONFIG, Fp8GemmConfig, fp8_gemm  # noqa: E402
from slipstream.ops.triton_fp8_gemm_skinny import Fp8SkinnyConfig, fp8_gemm_skinny, skinny_config_for  # noqa: E402
from slipstream.ops.triton_fp8_quant import quantize_rows  # noqa: E402
from slipstream.ops.triton_fp8_quant_tensor import quantize_tensor  # noqa: E402
from slipstream.quant.fp8 import Fp8Weight, quantize_blocks, quantize_per_channel, quantize_per_tensor  # noqa: E402

# (model, name, N, K)
SHAPES = [("8b", "qkv", 6144, 4096), ("8b", "o", 4096, 4096), ("8b", "gate_up", 28672, 4096),
          ("8b", "down", 4096, 14336), ("8b", "lm_head", 128256, 4096),
          ("0.6b", "qkv", 4096, 1024), ("0.6b", "o", 1024, 2048), ("0.6b", "gate_up", 6144, 1024),
          ("0.6b", "down", 1024, 3072), ("0.6b", "lm_head", 151936, 1024)]
SHAPES_TINY = [("tiny", "qkv", 384, 256), ("tiny", "down", 256, 512)]
ROWS = "8,16,32,64,128,256,2048,8192,16384"
ROWS_06B = [256]
LM_HEAD_MAX_ROWS = 2048
SKINNY_MAX_ROWS = 256
ROT_MIN, ROT_MAX, ROT_BYTES = 3, 32, 150e6  # weight copies: at least ROT_BYTES of bf16
TB_CONFIGS = {c.name: c for c in [
    Fp8GemmConfig(64, 128, 128, 8, 4, 3), Fp8GemmConfig(64, 128, 128, 8, 4, 4), Fp8GemmConfig(128, 128, 128, 8, 8, 3),
    Fp8GemmConfig(128, 128, 128, 8, 8, 4), Fp8GemmConfig(128, 256, 128, 8, 8, 3),
    Fp8GemmConfig(128, 128, 128, 8, 8, 3, persistent=True), Fp8GemmConfig(128, 128, 128, 8, 8, 4, persistent=True)]}
VARIANTS = ["bf16", "fp8", "fp8-block", "mm", "mm-fast", "mm-tensor", "mm-tensor-fast", "skinny", "skinny-block",
            "skinny-m128", "skinny-block-m128", "skinny-nopf", "skinny-s1",
            "triton", *TB_CONFIGS, "mm-block", "mm-block-v2"]
# what the routing table can pick, per layout (bench name -> table kernel)
ROUTABLE = {"channel": {"mm": "scaled_mm", "mm-fast": "scaled_mm_fast", "skinny": "skinny", "triton": "triton"},
            "block": {"skinny-block": "skinny", "mm-block": "scaled_mm_block",
                      **{t: ("triton" if c == DEFAULT_FP8_GEMM_CONFIG else t) for t, c in TB_CONFIGS.items()}}}


def scaled_mm_blockwise_v2(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """The same product as `scaled_mm_block` through torch.nn.functional.scaled_mm (torch's
    newer entry point, recipes named), for a torch whose `_scaled_mm` refuses block scales."""
    import torch.nn.functional as F
    if not hasattr(F, "scaled_mm"):
        raise NotImplementedError(f"torch {torch.__version__} has no torch.nn.functional.scaled_mm")
    q, s = quantize_rows(x, w.gamma, 128)
    kinds, none = F.ScalingType, F.SwizzleType.NO_SWIZZLE
    return F.scaled_mm(q, w.qweight.t(), s.t().contiguous().t(), kinds.BlockWise1x128, w.scale.t(),
                       kinds.BlockWise128x128, swizzle_a=none, swizzle_b=none, output_dtype=x.dtype)


def weight_sets(w: torch.Tensor) -> dict:
    """The weight in each layout the variants read."""
    qc, sc = quantize_per_channel(w)
    qb, sb = quantize_blocks(w, (128, 128))
    qt, st = quantize_per_tensor(w)
    return {"bf16": w, "channel": Fp8Weight(qc, sc), "block": Fp8Weight(qb, sb, (128, 128)),
            "tensor": (qt, st[:1].contiguous())}


def variant_fn(name: str, ws: dict):
    """x -> y for variant `name` over one weight set (None: not a variant of this script)."""
    if name == "bf16":
        return lambda x: linear(x, ws["bf16"])
    if name == "fp8":
        return lambda x: fp8_linear(x, ws["channel"])
    if name == "fp8-block":
        return lambda x: fp8_linear(x, ws["block"])
    if name in ("mm", "mm-fast", "skinny", "triton"):
        kernel = {"mm": "scaled_mm", "mm-fast": "scaled_mm_fast"}.get(name, name)
        return lambda x: fp8_product(x, ws["channel"], None, kernel)
    if name == "skinny-block":
        return lambda x: fp8_product(x, ws["block"], None, "skinny")
    if name in ("skinny-nopf", "skinny-s1"):  # the skinny tile for the rows without its L2 prefetch / K split
        def one_change(x):
            cfg = skinny_config_for(x.shape[0], *ws["channel"].shape)
            cfg = replace(cfg, prefetch_k=0) if name == "skinny-nopf" else replace(cfg, split_k=1)
            return fp8_gemm_skinny(x, ws["channel"], None, cfg)
        return one_change
    if name.endswith("-m128"):  # 128 activation rows a program (wgmma m64n128), K unsplit
        wt = ws["block" if "block" in name else "channel"]
        return lambda x: fp8_gemm_skinny(x, wt, None, Fp8SkinnyConfig(block_m=128, num_stages=4))
    if name == "mm-block":
        return lambda x: fp8_product(x, ws["block"], None, "scaled_mm_block")
    if name == "mm-block-v2":
        return lambda x: scaled_mm_blockwise_v2(x, ws["block"])
    if name in TB_CONFIGS:
        return lambda x: fp8_gemm(x, ws["block"], None, TB_CONFIGS[name])
    if name.startswith("mm-tensor"):
        qt, st = ws["tensor"]

        def tensorwise(x):
            q, s = quantize_tensor(x)
            return torch._scaled_mm(q, qt.t(), scale_a=s, scale_b=st, out_dtype=x.dtype,
                                    use_fast_accum=name.endswith("fast"))
        return tensorwise
    return None


def applies(name: str, m: int) -> bool:
    """The skinny kernel up to 256 rows; the other Triton block tiles from 256 rows (prefill)."""
    if name.startswith("skinny"):
        return m <= SKINNY_MAX_ROWS and (m >= 128 or not name.endswith("-m128"))
    return not (name in TB_CONFIGS and TB_CONFIGS[name] != DEFAULT_FP8_GEMM_CONFIG and m < 256)


def make_x(m: int, k: int, gen: torch.Generator, dev: str) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen, device=dev)
    x[:, ::97] *= 20  # a few outlier channels, as real activations have
    return x.to(torch.bfloat16)


def fast_accum_errors(shapes, dev: str, gen: torch.Generator) -> list[dict]:
    """Relative RMS error of _scaled_mm with and without fast accumulation against the exact
    product of the same FP8 operands (256 rows)."""
    out = []
    for model, name, n, k in shapes:
        if name == "lm_head":
            continue
        w = (torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).to(torch.bfloat16)
        ch = weight_sets(w)["channel"]
        x = make_x(256, k, gen, dev)
        q, s = quantize_rows(x)
        exact = (q.double() * s.double()) @ (ch.qweight.double() * ch.scale.double()[:, None]).t()
        row = dict(model=model, shape=name, k=k)
        for fast in (False, True):
            y = torch._scaled_mm(q, ch.qweight.t(), scale_a=s, scale_b=ch.scale[None, :], out_dtype=torch.bfloat16,
                                 use_fast_accum=fast)
            row["fast" if fast else "exact_accum"] = rel_rms(y, exact)
        out.append(row)
        print(f"fast accumulation {model} {name:8} K={k:6d}: relative RMS error {row['exact_accum']:.2e} "
              f"(fp32 accumulation) -> {row['fast']:.2e} (fast)")
    return out


def best_by_rows(results: list[dict], rows: list[int], names: list[str]) -> dict[int, str]:
    """Row count -> the variant of `names` with the least summed time over the 8B layer's four
    products (rows where every one of them ran)."""
    best = {}
    for m in rows:
        totals: dict[str, list[float]] = {}
        for r in results:
            if (r["model"] == "8b" and r["shape"] != "lm_head" and r["rows"] == m and r["variant"] in names
                    and not r.get("wrong")):
                totals.setdefault(r["variant"], []).append(r["ms"])
        full = {v: sum(t) for v, t in totals.items() if len(t) == 4}
        if full:
            best[m] = min(full, key=full.get)
    return best


def suggest_routes(results: list[dict], rows: list[int]) -> str:
    """Per layout, the routable kernel with the least summed time over the 8B layer's four
    products at each row count, compressed to a SLIPSTREAM_FP8_ROUTES string."""
    parts = []
    for layout, names in ROUTABLE.items():
        best = [(m, names[v]) for m, v in best_by_rows(results, rows, list(names)).items()]
        if not best:
            continue
        routes = []
        for i, (m, kernel) in enumerate(best):
            if i + 1 < len(best) and best[i + 1][1] == kernel:
                continue
            routes.append(kernel if i + 1 == len(best) else f"{kernel}:{m}")
        parts.append(f"{layout}={','.join(routes)}")
    return "/".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default=None, help=f"rows of the 8B shapes (the 0.6B's run at 256; default {ROWS})")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--shapes", default=None, help="e.g. 8b:o,8b:down (default: all)")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    dev = "cpu" if args.tiny else "cuda"
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {','.join(VARIANTS)}")
    if "bf16" not in variants:
        variants = ["bf16", *variants]  # the baseline of `x`
    shapes = SHAPES_TINY if args.tiny else SHAPES
    if args.shapes:
        shapes = [s for s in shapes if f"{s[0]}:{s[1]}" in args.shapes.split(",")]
    rows8b = [int(r) for r in (args.rows or ("4,24" if args.tiny else ROWS)).split(",")]
    gen = torch.Generator(device=dev).manual_seed(0)
    results, unsupported = [], {}
    for model, name, n, k in shapes:
        rot = 1 if args.tiny else min(ROT_MAX, max(ROT_MIN, -int(-ROT_BYTES // (2 * n * k))))
        ws_rot = [weight_sets((torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).to(torch.bfloat16))
                  for _ in range(rot)]
        rows = ROWS_06B if model == "0.6b" else [m for m in rows8b if name != "lm_head" or m <= LM_HEAD_MAX_ROWS]
        print(f"\n{model} {name} N={n} K={k}: TFLOP/s (x bf16), activation quantization included")
        shown = [v for v in variants if v not in unsupported]
        print(f"{'rows':>6} " + " ".join(f"{v:>16}" for v in shown))
        for m in rows:
            x = make_x(m, k, gen, dev)
            w0 = ws_rot[0]["bf16"]
            exact = x[:64].double() @ w0.double().t()
            cells, base = [], None
            for v in shown:
                if v in unsupported or not applies(v, m):
                    cells.append(f"{'-':>16}")
                    continue
                fns = [variant_fn(v, ws) for ws in ws_rot]
                try:
                    err = rel_rms(fns[0](x)[:64], exact)
                except (RuntimeError, NotImplementedError, ValueError) as e:
                    unsupported[v] = str(e).splitlines()[0][:200]
                    print(f"  {v}: unsupported here: {unsupported[v]}")
                    cells.append(f"{'n/a':>16}")
                    continue
                if not err <= 0.1:  # reported, not timed; the other variants go on
                    print(f"  WRONG: {model} {name} rows {m} {v}: relative RMS error {err:.3f}")
                    results.append(dict(model=model, shape=name, n=n, k=k, rows=m, variant=v, wrong=True,
                                        rel_rms_err=err))
                    cells.append(f"{'WRONG':>16}")
                    continue
                try:
                    ms = time_graph([lambda fn=fn, x=x: fn(x) for fn in fns], device=dev)
                except RuntimeError as e:  # e.g. not capturable: reported, the others go on
                    print(f"  FAILED under a CUDA graph: {model} {name} rows {m} {v}: {str(e).splitlines()[0][:200]}")
                    cells.append(f"{'FAILED':>16}")
                    continue
                base = ms if v == "bf16" else base
                tflops = 2 * m * n * k / ms / 1e9
                results.append(dict(model=model, shape=name, n=n, k=k, rows=m, variant=v, ms=ms, tflops=tflops,
                                    speedup_vs_bf16=base / ms, rel_rms_err=err))
                cells.append(f"{tflops:9.1f} ({base / ms:4.2f})")
            print(f"{m:6d} " + " ".join(cells), flush=True)
        del ws_rot
        if dev == "cuda":
            torch.cuda.empty_cache()
    routes = suggest_routes(results, rows8b)
    print(f"\nfastest routable kernels (8B qkv+o+gate_up+down): SLIPSTREAM_FP8_ROUTES=\"{routes}\"")
    print("fastest Triton block tile (8B qkv+o+gate_up+down; `triton` routes use Fp8GemmConfig's default):",
          ", ".join(f"{m}: {v}" for m, v in best_by_rows(results, rows8b, list(TB_CONFIGS)).items()))
    accum = [] if args.tiny else fast_accum_errors([s for s in shapes if s[0] == "8b"], dev, gen)
    for v, why in unsupported.items():
        print(f"unsupported: {v}: {why}")
    if args.out:
        meta = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if dev == "cuda" else "cpu")
        print("wrote", write_json(args.out, "bench_fp8_gemm.json",
                                  dict(meta=meta, results=results, suggested_routes=routes, fast_accum=accum,
                                       unsupported=unsupported)))


if __name__ == "__main__":
    main()
