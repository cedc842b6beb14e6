"""The MoE router on the Qwen3-30B-A3B shape (128 experts, top 8, hidden 2048), bf16: time per
layer of its three forms, a step's 48 layers (each its own router weight) in one CUDA graph
(`cuda_timing.time_graph`), with the kernels' PDL as in the engine:

    torch   the router linear (`ops.linear.linear`: the GEMV at one row), then `route_ref`'s
            torch ops (~5 launches)
    triton  the linear, then `route_triton` (one launch)
    fused   `route_linear_triton`: the linear inside the top-k kernel (up to 16 rows)

Also checks that the forms agree: ids equal, weights within float32 rounding (random bf16
inputs can tie or round a logit differently between the linear's and the fused kernel's order
of sums; the share of equal rows is printed).

    python benchmarks/bench_route.py [--tokens 1 2 8 16 256 8192]
"""
from __future__ import annotations

import argparse

import torch

from slipstream.bench.cuda_timing import time_graph
from slipstream.ops.linear import linear
from slipstream.ops.moe import route_ref
from slipstream.ops.triton_route import (
    new_route_counter,
    route_linear_applies,
    route_linear_triton,
    route_triton,
)

EXPERTS, TOP_K, HIDDEN, LAYERS = 128, 8, 2048, 48


def _agree(a, b) -> str:
    same = (a[1] == b[1]).all(-1).float().mean().item()
    rows = (a[1] == b[1]).all(-1)
    err = (a[0][rows] - b[0][rows]).abs().max().item() if rows.any() else float("nan")
    return f"rows equal {same:6.1%}, max weight diff there {err:.1e}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 8, 16, 256, 8192])
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    gates = [torch.randn(EXPERTS, HIDDEN, device=dev, generator=g).mul_(0.02).bfloat16() for _ in range(LAYERS)]
    counters = [new_route_counter(dev) for _ in range(LAYERS)]
    print(f"{torch.cuda.get_device_name()}: us per layer ({LAYERS} layers in one graph)")
    for t in args.tokens:
        x = torch.randn(t, HIDDEN, device=dev, generator=g).bfloat16()
        logits = linear(x, gates[0])
        ref = route_ref(logits, TOP_K, True)
        tri = route_triton(logits, TOP_K, True)
        line = f"T={t:5d}"
        forms = {"torch": lambda w, c, x=x: route_ref(linear(x, w), TOP_K, True),
                 "triton": lambda w, c, x=x: route_triton(linear(x, w), TOP_K, True)}
        if route_linear_applies(x, gates[0], TOP_K):
            forms["fused"] = lambda w, c, x=x: route_linear_triton(x, w, TOP_K, True, c)
        for name, form in forms.items():
            calls = [lambda w=w, c=c, form=form: form(w, c) for w, c in zip(gates, counters)]
            us = 1e3 * time_graph(calls) / LAYERS
            line += f"  {name} {us:6.2f}"
        print(line + f"   triton vs torch: {_agree(tri, ref)}", flush=True)
        if "fused" in forms:
            fused = route_linear_triton(x, gates[0], TOP_K, True, counters[0])
            print(f"         fused vs torch: {_agree(fused, ref)}", flush=True)


if __name__ == "__main__":
    main()
