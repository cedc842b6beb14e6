#!/usr/bin/env python
"""The small-batch GEMV (`slipstream.ops.triton_gemv`) against cuBLAS on a decode step's
layer GEMMs, as the model runs them: every layer's qkv, o (+= residual), gate_up and down
(+= residual), each layer with its own weights, so the chain streams the whole model's
layer weights as a step does (more than L2).

    python benchmarks/bench_gemv.py [--out DIR] [--models 0.6b,135m,8b] [--rows 1,2,4,8]
                                    [--variant NAME:k=v,...] [--fused]

A model name with `-l2` (e.g. `0.6b-l2`) runs the same chain with every layer sharing the
first layer's weights (the 0.6B layer's 30 MB fit in the H200's L2): what the chain costs
when its weights come from L2 instead of DRAM, i.e. the most that prefetching the next
layers' weights into L2 could give it.

One CUDA graph per (model shape, M, implementation) holds the whole chain; the median of
20 replays is reported, with its bytes' time at the measured copy bandwidth.  Every
implementation is first checked against F.linear on the first layer.  Variants override
`GemvConfig` fields (block_n, num_warps, programs_per_sm, tile_elems).  The FP8 GEMV's sweep
is benchmarks/bench_fp8_gemv.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch  # noqa: E402
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from slipstream.bench.cuda_timing import time_graph  # noqa: E402
from slipstream.bench.report import write_json  # noqa: E402
from slipstream.ops.device import sm_count  # noqa: E402
from slipstream.ops.triton_gemv import GemvConfig, gemv  # noqa: E402
from slipstream.utils.overrides import parse_overrides  # noqa: E402

# name -> (layers, hidden, q heads, kv heads, head_dim, intermediate)
SHAPES = {"0.6b": (28, 1024, 16, 8, 128, 3072), "135m": (30, 576, 9, 3, 64, 1536),
          "8b": (4, 4096, 32, 8, 128, 14336)}  # 8b: 4 layers are already > L2


def layer_weights(shape, dev, dt, gen):
    layers, hidden, hq, hkv, hd, inter = shape
    def w(n, k):
        return (torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).to(dt)
    return [dict(qkv=w((hq + 2 * hkv) * hd, hidden), o=w(hidden, hq * hd), gate_up=w(2 * inter, hidden),
                 down=w(hidden, inter)) for _ in range(layers)]


def chain(weights, m, impl, cfg, dev, dt, fused=False):
    """A closure running every layer's four GEMMs at batch m with `impl`; `fused`: in the
    forms the model's one-row layer takes (qkv and gate_up scaled by the input row's rstd,
    down's input silu(gate) * up of gate_up's output), for the GEMV only."""
    hidden = weights[0]["o"].shape[0]
    h = torch.randn(m, hidden, device=dev, dtype=dt)
    attn = torch.randn(m, weights[0]["o"].shape[1], device=dev, dtype=dt)
    act = torch.randn(m, weights[0]["down"].shape[1], device=dev, dtype=dt)
    qkv = torch.empty(m, weights[0]["qkv"].shape[0], device=dev, dtype=dt)
    gu = torch.empty(m, weights[0]["gate_up"].shape[0], device=dev, dtype=dt)

    def run():
        for lw in weights:
            if impl == "cublas":
                torch.matmul(h, lw["qkv"].t(), out=qkv)
                h.addmm_(attn, lw["o"].t())
                torch.matmul(h, lw["gate_up"].t(), out=gu)
                h.addmm_(act, lw["down"].t())
            elif fused:
                gemv(h, lw["qkv"], out=qkv, cfg=cfg, row_scale_eps=1e-6)
                gemv(attn, lw["o"], residual=h, out=h, cfg=cfg)
                gemv(h, lw["gate_up"], out=gu, cfg=cfg, row_scale_eps=1e-6)
                gemv(gu, lw["down"], residual=h, out=h, cfg=cfg, silu_mul=True)
            else:
                gemv(h, lw["qkv"], out=qkv, cfg=cfg)
                gemv(attn, lw["o"], residual=h, out=h, cfg=cfg)
                gemv(h, lw["gate_up"], out=gu, cfg=cfg)
                gemv(act, lw["down"], residual=h, out=h, cfg=cfg)
    return run


def check(weights, cfg, dev, dt) -> float:
    err = 0.0
    for m in (1, 3, 8):
        for name, w in weights[0].items():
            x = torch.randn(m, w.shape[1], device=dev, dtype=dt)
            r = torch.randn(m, w.shape[0], device=dev, dtype=dt)
            ref = F.linear(x.float(), w.float()) + r.float()
            y = gemv(x, w, residual=r, cfg=cfg).float()
            e = ((y - ref).abs().max() / ref.abs().max()).item()
            if e > 1e-2:
                raise AssertionError(f"{name} m={m}: relative error {e:.2e}")
            err = max(err, e)
    return err


def copy_bandwidth(dev) -> float:
    """Eager (a graph would make the copy a copy-engine memcpy node, ~35% slower)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 2 * src.numel() / (sorted(times)[len(times) // 2] * 1e-3)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--models", default="0.6b,135m,8b")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--fused", action="store_true", help="the GEMVs in the model's one-row forms (chain())")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    sms = sm_count(dev)
    impls = {"cublas": None, "gemv": GemvConfig(max_rows=8, max_weight_bytes=1 << 40)}
    for spec in args.variant:
        name, _, body = spec.partition(":")
        impls[name] = dataclasses.replace(impls["gemv"], **parse_overrides(GemvConfig, body))
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}, {sms} SMs, torch {torch.__version__}; copy {bw / 1e12:.2f} TB/s")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    print("| model | M | impl | chain us | per layer us | weight MB | bytes' time us | x floor | vs cublas |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        shape = SHAPES[model.removesuffix("-l2")]
        if model.endswith("-l2"):  # one layer's weights, read by every layer (from L2)
            weights = layer_weights((1, *shape[1:]), dev, dt, gen) * shape[0]
        else:
            weights = layer_weights(shape, dev, dt, gen)
        nbytes = sum(w.numel() * w.element_size() for lw in weights for w in lw.values())
        floor_us = nbytes / bw * 1e6
        errs = {name: check(weights, cfg, dev, dt) for name, cfg in impls.items() if cfg is not None}
        for m in (int(r) for r in args.rows.split(",")):
            base = None
            for name, cfg in impls.items():
                us = time_graph([chain(weights, m, "cublas" if cfg is None else "gemv", cfg, dev, dt,
                                       args.fused)]) * 1e3
                base = base or us
                row = dict(model=model, m=m, impl=name, fused=args.fused, config=dataclasses.asdict(cfg) if cfg else None,
                           us=us, per_layer_us=us / len(weights), weight_bytes=nbytes, floor_us=floor_us,
                           x_floor=us / floor_us, vs_cublas=us / base, max_rel_err=errs.get(name))
                rows.append(row)
                print(f"| {model} | {m} | {name} | {us:.1f} | {row['per_layer_us']:.2f} | {nbytes / 1e6:.0f} | "
                      f"{floor_us:.1f} | {row['x_floor']:.2f} | {row['vs_cublas']:.2f} |", flush=True)
        del weights
        torch.cuda.empty_cache()
    if args.out:
        print("wrote", write_json(args.out, "gemv_bench.json", dict(copy_bw=bw, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
