"""The fused MoE layer on the Qwen3-30B-A3B shape (128 experts, top 8, hidden 2048, expert
width 768), bf16: correctness against the per-expert loop, then time per call (all calls of a
size in one CUDA graph, `cuda_timing.time_graph`) against its floor.

Floor of a call: the weights of the distinct experts the call's routing touches (counted),
plus x, the routing and y, at the copy bandwidth; or its flops (2 x T x k x 3 x H x I) at the
matmul rate (both measured on the GPU at hand), whichever is longer. Uniform random routing, as the engine's dummy weights give.
Each size is timed on the path the engine takes (`ops.moe.fused_moe`: the small-batch kernels up
to SMALL_MOE_TOKENS tokens, the grouped GEMMs past it); `--sweep T ..` times other grouped tiles
at those sizes, `--small-variants` both paths (the small one in each of SMALL_SWEEP's tiles) at
`--small-tokens` (1 2 4 8): the measurements that set SMALL_MOE_TOKENS and the default tiles;
`--with-router` times the block's decode chain as the engine runs it (router kernel, then experts).

    python benchmarks/bench_moe.py [--tokens 1 8 64 256 2048 8192] [--small-variants] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from slipstream.bench.cuda_timing import time_graph
from slipstream.bench.throughput import measure_ceilings
from slipstream.ops.moe import (
    SMALL_MOE_TOKENS,
    fused_moe,
    fused_moe_ref,
    moe_path,
    route,
    route_linear,
)
from slipstream.ops.triton_moe import (
    MoEConfig,
    align_by_expert,
    fused_moe_triton,
    moe_config,
)
from slipstream.ops.triton_moe_small import (
    DEFAULT_SMALL_CONFIG,
    fused_moe_small,
)

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
SWEEP = [MoEConfig(16, 64, 128, 4, 4), MoEConfig(16, 128, 128, 4, 4), MoEConfig(32, 64, 128, 4, 4),
         MoEConfig(64, 128, 64, 4, 4), MoEConfig(64, 128, 64, 8, 3), MoEConfig(128, 128, 64, 8, 3),
         MoEConfig(64, 256, 64, 8, 3), MoEConfig(128, 256, 64, 8, 3)]
# the small path's default tiles, then each field changed alone
SMALL_SWEEP = [DEFAULT_SMALL_CONFIG] + [replace(DEFAULT_SMALL_CONFIG, **{field: v}) for field, values in (
    ("num_stages", (2, 3, 5)), ("up_block_n", (8, 32)), ("up_block_k", (64, 256)), ("down_block_n", (4, 16)),
    ("down_block_k", (128, 512)), ("num_warps", (2, 8))) for v in values] + [
    # pairs of the single changes that helped at one token on an H100
    replace(DEFAULT_SMALL_CONFIG, **kw) for kw in (
        dict(down_block_n=4, num_warps=2), dict(down_block_n=4, num_stages=5), dict(down_block_n=4, up_block_n=32),
        dict(down_block_n=4, num_warps=2, num_stages=5), dict(num_warps=2, num_stages=5), dict(down_block_n=2),
        dict(down_block_n=2, num_warps=2), dict(down_block_n=4, up_block_n=32, num_warps=2))]


def _check(out: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-2, f"{what}: max error {err:.3g} of the largest output"
    return err


def small_variants(t: int, x, layers, weights, ids, floor_us: float, ref: torch.Tensor) -> list[dict]:
    """Both paths at t tokens: the grouped GEMMs (moe_config's tile) and the small kernels in
    each SMALL_SWEEP tile, each checked against the reference, then timed."""
    runs = [("grouped", lambda w: fused_moe_triton(x, w[0], w[1], weights, ids))]
    runs += [((f"small up {c.up_block_n}x{c.up_block_k} down {c.down_block_n}x{c.down_block_k} "
               f"w{c.num_warps} s{c.num_stages}"), lambda w, c=c: fused_moe_small(x, w[0], w[1], weights, ids, c)) for c in SMALL_SWEEP]
    out = []
    for name, fn in runs:
        err = _check(fn(layers[0]), ref, f"T={t} {name}")
        us = 1e3 * time_graph([lambda w=w, fn=fn: fn(w) for w in layers])
        out.append(dict(path=name, us=us, over_floor=us / floor_us, max_rel_err=err))
        print(f"    T={t} {name:40s} {us:8.1f} us  x{us / floor_us:5.2f}", flush=True)
    return out


def with_router(t: int, x: torch.Tensor, layers, floor_us: float, bandwidth: float) -> float:
    """The MoE block's decode chain: `route_linear` (the router's linear and top-k, one launch),
    then `fused_moe` adding into the residual, per weight set, its own router weight and
    counter (the expert weights' floor plus the router's bytes)."""
    g = torch.Generator(device=x.device).manual_seed(t)
    routers = [(torch.randn(EXPERTS, HIDDEN, device=x.device, generator=g) * 0.02).bfloat16() for _ in layers]
    counters = [torch.zeros(1, dtype=torch.int32, device=x.device) for _ in layers]
    h = torch.zeros_like(x)

    def block(w, router, counter):
        fused_moe(x, w[0], w[1], *route_linear(x, router, TOP_K, True, counter), residual=h)

    block(layers[0], routers[0], counters[0])  # compiles
    us = 1e3 * time_graph([lambda a=a: block(*a) for a in zip(layers, routers, counters)])
    floor = floor_us + 1e6 * EXPERTS * HIDDEN * 2 / bandwidth
    print(f"    T={t} with the fused router: {us:8.1f} us  floor {floor:6.1f} us  x{us / floor:5.2f}", flush=True)
    return us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 2048, 8192])
    ap.add_argument("--layers", type=int, default=2, help="weight sets in rotation (each 1.2 GB)")
    ap.add_argument("--sweep", type=int, nargs="*", default=[], help="token counts to time other tiles at")
    ap.add_argument("--small-variants", action="store_true",
                    help="at --small-tokens: the grouped path and the small path's SMALL_SWEEP tiles")
    ap.add_argument("--small-tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--with-router", action="store_true",
                    help="up to 16 tokens: also time the block as the engine runs it, the fused router "
                         "(`route_linear`) then the experts into the residual, each layer its own router")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    bandwidth, rate = measure_ceilings(dev)
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s, matmul {rate / 1e12:.0f} TFLOP/s")
    g = torch.Generator(device=dev).manual_seed(0)
    layers = [(torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, generator=g).mul_(0.02).bfloat16(),
               torch.randn(EXPERTS, HIDDEN, INTER, device=dev, generator=g).mul_(0.02).bfloat16())
              for _ in range(args.layers)]
    rows = []
    print(f"small-batch path up to {SMALL_MOE_TOKENS} tokens (SLIPSTREAM_MOE_SMALL_TOKENS)")
    tokens = sorted(set(args.tokens) | (set(args.small_tokens) if args.small_variants else set()))
    for t in tokens:
        x = torch.randn(t, HIDDEN, device=dev, generator=g).bfloat16()
        logits = torch.randn(t, EXPERTS, device=dev, generator=g)
        weights, ids = route(logits, TOP_K, renormalize=True)
        w_gate_up, w_down = layers[0]
        ref = fused_moe_ref(x, w_gate_up, w_down, weights, ids).float()
        err = _check(fused_moe(x, w_gate_up, w_down, weights, ids), ref, f"T={t}")
        touched = ids.unique().numel()
        nbytes = touched * 3 * HIDDEN * INTER * 2 + t * HIDDEN * 2 * 2 + ids.numel() * 8
        flops = 2 * t * TOP_K * 3 * HIDDEN * INTER
        floor_us = 1e6 * max(nbytes / bandwidth, flops / rate)
        calls = [lambda w=w: fused_moe(x, w[0], w[1], weights, ids) for w in layers]
        us = 1e3 * time_graph(calls)
        cfg = moe_config(t * TOP_K, EXPERTS)
        align_us = 1e3 * time_graph([lambda: align_by_expert(ids, EXPERTS, cfg.block_m)] * 8)
        row = dict(tokens=t, experts_touched=touched, us=us, floor_us=floor_us, over_floor=us / floor_us,
                   align_us=align_us, max_rel_err=err, block_m=cfg.block_m, path=moe_path(t))
        rows.append(row)
        print(f"T={t:5d} experts={touched:3d} {us:9.1f} us  floor {floor_us:8.1f} us  x{us / floor_us:5.2f}  "
              f"align {align_us:6.1f} us  err {err:.2e}  ({moe_path(t)})", flush=True)
        if args.with_router and t <= 16:
            row["with_router_us"] = with_router(t, x, layers, floor_us, bandwidth)
        if args.small_variants and t in args.small_tokens:
            row["small_variants"] = small_variants(t, x, layers, weights, ids, floor_us, ref)
        if t in args.sweep:  # other tiles at this size
            for c in SWEEP:
                alt = [lambda w=w, c=c: fused_moe_triton(x, w[0], w[1], weights, ids, c) for w in layers]
                alt_us = 1e3 * time_graph(alt)
                row.setdefault("sweep", []).append(dict(config=str(c), us=alt_us))
                print(f"    {c}: {alt_us:9.1f} us  x{alt_us / floor_us:5.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
