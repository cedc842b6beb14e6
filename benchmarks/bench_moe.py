"""The fused MoE layer on the Qwen3-30B-A3B shape (128 experts, top 8, hidden 2048, expert
width 768), bf16: correctness against the per-expert loop, then time per call (all calls of a
size in one CUDA graph, `cuda_timing.time_graph`) against its floor.

Floor of a call: the weights of the distinct experts the call's routing touches (counted),
plus x, the routing and y, at the copy bandwidth; or its flops (2 x T x k x 3 x H x I) at the
matmul rate (both measured on the GPU at hand), whichever is longer. Uniform random routing, as the engine's dummy weights give.

    python benchmarks/bench_moe.py [--tokens 1 8 64 256 2048 8192] [--out results.json]
"""
from __future__ import annotations

import argparse
import json

import torch

from slipstream.bench.cuda_timing import time_graph
from slipstream.bench.throughput import measure_ceilings
from slipstream.ops.moe import fused_moe_ref, route
from slipstream.ops.triton_moe import MoEConfig, align_by_expert, fused_moe_triton, moe_config

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
SWEEP = [MoEConfig(16, 64, 128, 4, 4), MoEConfig(16, 128, 128, 4, 4), MoEConfig(32, 64, 128, 4, 4),
         MoEConfig(64, 128, 64, 4, 4), MoEConfig(64, 128, 64, 8, 3), MoEConfig(128, 128, 64, 8, 3),
         MoEConfig(64, 256, 64, 8, 3), MoEConfig(128, 256, 64, 8, 3)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 2048, 8192])
    ap.add_argument("--layers", type=int, default=2, help="weight sets in rotation (each 1.2 GB)")
    ap.add_argument("--sweep", type=int, nargs="*", default=[], help="token counts to time other tiles at")
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
    for t in args.tokens:
        x = torch.randn(t, HIDDEN, device=dev, generator=g).bfloat16()
        logits = torch.randn(t, EXPERTS, device=dev, generator=g)
        weights, ids = route(logits, TOP_K, renormalize=True)
        w_gate_up, w_down = layers[0]
        ref = fused_moe_ref(x, w_gate_up, w_down, weights, ids).float()
        out = fused_moe_triton(x, w_gate_up, w_down, weights, ids).float()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-2, f"T={t}: max error {err:.3g} of the largest output"
        touched = ids.unique().numel()
        nbytes = touched * 3 * HIDDEN * INTER * 2 + t * HIDDEN * 2 * 2 + ids.numel() * 8
        flops = 2 * t * TOP_K * 3 * HIDDEN * INTER
        floor_us = 1e6 * max(nbytes / bandwidth, flops / rate)
        calls = [lambda w=w: fused_moe_triton(x, w[0], w[1], weights, ids) for w in layers]
        us = 1e3 * time_graph(calls)
        cfg = moe_config(t * TOP_K, EXPERTS)
        align_us = 1e3 * time_graph([lambda: align_by_expert(ids, EXPERTS, cfg.block_m)] * 8)
        row = dict(tokens=t, experts_touched=touched, us=us, floor_us=floor_us, over_floor=us / floor_us,
                   align_us=align_us, max_rel_err=err, block_m=cfg.block_m)
        rows.append(row)
        print(f"T={t:5d} experts={touched:3d} {us:9.1f} us  floor {floor_us:8.1f} us  x{us / floor_us:5.2f}  "
              f"align {align_us:6.1f} us  err {err:.2e}", flush=True)
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
