"""Speculative decoding's per-step device work, each timed inside a CUDA graph (median of
replays): n-gram drafting over the batch's token history (`propose_ngram_device`) and the
acceptance (`rejection_sample`, point-mass drafts and drafts with probabilities), at the
Llama-3 vocabulary (128,256), for R rows and k drafts. These run once a step beside the
verification forward, so they should stay a small part of a decode step (3.9-5.3 ms on the
8B shape at one row).

Usage: python benchmarks/bench_spec_ops.py [--out DIR] [--device cuda|cpu]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from slipstream.bench.cuda_timing import time_graph
from slipstream.bench.report import write_json
from slipstream.spec.ngram import propose_ngram_device
from slipstream.spec.rejection import rejection_sample

V = 128256


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--history", type=int, default=4096, help="token history length L")
    args = ap.parse_args()
    dev = args.device
    rows = []
    print("| op | R | k | us |")
    print("|---|---|---|---|")
    for R in (1, 8, 32):
        g = torch.Generator().manual_seed(R)
        history = torch.randint(0, 50, (R, args.history), generator=g, dtype=torch.int32).to(dev)
        lengths = torch.full((R,), args.history - 7, dtype=torch.int32, device=dev)
        for k in (1, 2, 4, 7):
            us = 1e3 * time_graph([lambda h=history, n=lengths, k=k: propose_ngram_device(h, n, k, 2, 5)], device=dev)
            rows.append(dict(op="ngram", R=R, k=k, us=us))
            print(f"| propose_ngram_device L={args.history} n=2..5 | {R} | {k} | {us:.1f} |")
            logits = (torch.randn(R, k + 1, V, generator=g) * 2).to(dev)
            drafts = logits[:, :k].argmax(-1)
            num = torch.full((R,), k, device=dev)
            greedy = torch.zeros(R, dtype=torch.bool, device=dev)
            seed, index = torch.arange(R, device=dev) * 7, torch.zeros(R, dtype=torch.int32, device=dev)
            probs = torch.softmax(torch.randn(R, k, V, generator=g), -1).to(dev)
            for name, q in (("point mass", None), ("draft probs", probs)):
                call_args = (logits, drafts, num, q, greedy, seed, index)
                us = 1e3 * time_graph([lambda a=call_args: rejection_sample(*a)], device=dev)
                rows.append(dict(op=f"rejection {name}", R=R, k=k, us=us))
                print(f"| rejection_sample, {name} | {R} | {k} | {us:.1f} |")
    if args.out:
        write_json(args.out, "bench_spec_ops.json", dict(rows=rows, vocab=V, history=args.history))
    return 0


if __name__ == "__main__":
    sys.exit(main())
