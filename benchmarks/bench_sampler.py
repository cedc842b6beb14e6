"""The sampling kernel on the Qwen3-0.6B vocabulary (151,936), bf16 logits, per launch shape.

For each batch size: the default launch and explicit (splits, block) variants, timed in a
CUDA graph (median of replays), against the floor (logits bytes / copy bandwidth).  With
`--old FILE` (an earlier `triton_sampling.py`), the same calls through that file's
kernel are timed alongside and the tokens compared.

Usage: python benchmarks/bench_sampler.py [--old FILE] [--out DIR]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from slipstream.bench.cuda_timing import time_graph  # noqa: E402
from slipstream.bench.report import write_json  # noqa: E402
from slipstream.ops import triton_sampling  # noqa: E402

V = 151936
BW = 4.26e12


def load_old(path: str):
    spec = importlib.util.spec_from_file_location("old_sampling", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def inputs(B: int, temperature: float):
    g = torch.Generator(device="cuda").manual_seed(B)
    logits = (torch.randn(B, V, generator=g, device="cuda") * 2).to(torch.bfloat16)
    temp = torch.full((B,), temperature, device="cuda")
    inv_t = torch.where(temp < 1e-5, torch.ones_like(temp), temp).reciprocal()
    lmp = torch.full((B,), float("-inf"), device="cuda")
    seed = torch.arange(B, dtype=torch.int64, device="cuda") * 7919
    tidx = torch.full((B,), 11, dtype=torch.int32, device="cuda")
    return logits, temp, inv_t, lmp, seed, tidx


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    impls = {"new": triton_sampling}
    if args.old:
        impls["old"] = load_old(args.old)
    # (splits, block, warps); None = the default's choice
    variants = [(None, None, None), (8, 2048, None), (16, 2048, None), (None, 2048, 16),
                (None, 1024, 8), (None, 1024, 4), (16, 1024, 8), (None, 512, 4), (16, 512, 4),
                (None, 512, 2)]
    rows = []
    print("| B | temp | impl | splits, block, warps | us | floor us | same tokens as new default |")
    print("|---|---|---|---|---|---|---|")
    for B, temperature in ((256, 0.6), (128, 0.6), (32, 0.6), (8, 0.6), (256, 0.0), (32, 0.0)):
        x = inputs(B, temperature)
        floor_us = 1e6 * x[0].numel() * 2 / BW
        ref = triton_sampling.sample_tokens_triton(x[0], x[1], x[2], x[3], None, x[4], x[5])
        for name, mod in impls.items():
            for splits, block, warps in variants:
                if name == "old" and block is not None:
                    continue
                kw = dict(num_splits=splits, block_v=block)
                if warps is not None:
                    kw["num_warps"] = warps

                def call(mod=mod, kw=kw):
                    return mod.sample_tokens_triton(x[0], x[1], x[2], x[3], None, x[4], x[5], **kw)
                same = bool(torch.equal(call(), ref))
                us = 1e3 * time_graph([call] * 10)
                label = "default" if block is None else f"{splits or 'auto'}, {block}, {warps or 'auto'} warps"
                print(f"| {B} | {temperature} | {name} | {label} | {us:.1f} | {floor_us:.1f} | {same} |")
                rows.append(dict(B=B, temperature=temperature, impl=name, splits=splits, block=block,
                                 warps=warps, us=us,
                                 floor_us=floor_us, same=same))
    if args.out:
        write_json(args.out, "bench_sampler.json", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
