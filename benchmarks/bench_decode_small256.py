#!/usr/bin/env python
"""Decode attention on small-256's own batches (Qwen3-0.6B shape), one CUDA GPU.

    python benchmarks/bench_decode_small256.py [--tree DIR] [--out DIR]

The batches: after the prompts are in, decode step t holds the requests with
max_tokens > t, each at context prompt_len + t + 1 (small-256: 256 requests, prompts and
max_tokens uniform in 100..1024).  For several t, one layer's decode attention (16 q heads,
8 KV heads, head_dim 128, bf16, block_size 16, block tables in random order) is timed with
the split count the runner would pick (`pick`) and with forced split counts (`sN`), and
with 128-token KV tiles (`pick-n128`).  `--tree DIR` imports slipstream from another
source tree (an A/B of two versions of the kernel in one call: the API used here is the
same in both).  Timing as in bench_attention.py: every call captured with the same call on
two other caches in one CUDA graph, median of 20 replays.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys


def _tree() -> str:
    if "--tree" in sys.argv:
        return os.path.abspath(sys.argv[sys.argv.index("--tree") + 1])
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


sys.path.insert(0, _tree())

import torch  # noqa: E402
import triton  # noqa: E402

from slipstream.bench import cuda_timing  # noqa: E402
from slipstream.ops import triton_attention as ta  # noqa: E402
from slipstream.ops.attention import AttentionMetadata, paged_attention_ref  # noqa: E402
from slipstream.ops.device import sm_count  # noqa: E402
from slipstream.runner.graphs import capture_sizes  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, MAX_LEN = 16, 8, 128, 16, 2048
DTYPE = torch.bfloat16
SCALE = HEAD_DIM ** -0.5
STEPS = (20, 150, 300, 450, 600, 750, 900, 980)
FORCED = (1, 2, 3, 4, 6, 8)


def small256_lens(t: int) -> list[int]:
    random.seed(0)
    pairs = [(random.randint(100, 1024), random.randint(100, 1024)) for _ in range(256)]
    return [p + t + 1 for p, m in pairs if m > t]


def make_batch(lens, gen, device):
    blocks = [triton.cdiv(s, BLOCK_SIZE) for s in lens]
    num_blocks = sum(blocks) + 1
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    bt = torch.zeros((len(lens), triton.cdiv(MAX_LEN, BLOCK_SIZE)), dtype=torch.int32)
    i = 0
    for r, nb in enumerate(blocks):
        bt[r, :nb] = perm[i:i + nb]
        i += nb
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, device=device, dtype=DTYPE)
    v = torch.randn(shape, device=device, dtype=DTYPE)
    n = len(lens)
    q = torch.randn((n, NUM_HEADS, HEAD_DIM), device=device, dtype=DTYPE)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
        seq_lens=seq_lens.to(device), block_table=bt.to(device),
        slot_mapping=torch.full((n,), -1, dtype=torch.int32, device=device),
        max_query_len=1, max_seq_len=MAX_LEN,  # the graphs' bound, as the runner passes it
        decode_order=torch.argsort(-seq_lens, stable=True).to(torch.int32).to(device),
        split_counters=torch.zeros(n * NUM_KV_HEADS, dtype=torch.int32, device=device))
    return q, k, v, meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", help="import slipstream from this source tree")
    ap.add_argument("--out", help="write decode_small256.json here")
    ap.add_argument("--label", default="", help="a name for this tree in the table")
    args = ap.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    cfg = ta.effective_decode_config(ta.DEFAULT_DECODE_CONFIG, DTYPE, HEAD_DIM)
    policy = ta.DecodeSplitPolicy(NUM_KV_HEADS, MAX_LEN, cfg, sm_count(device))
    sizes = capture_sizes(256)
    label = args.label or os.path.basename(_tree())
    rows = []
    print(f"| tree | step | rows | sum ctx | variant | splits | us | % of copy |")
    print("|---|---|---|---|---|---|---|---|")
    copy_bw = 4.26e12  # design brief §5 (the floors' bandwidth)
    for t in STEPS:
        lens = small256_lens(t)
        size = next(s for s in sizes if s >= len(lens))
        picked = policy.pick(torch.tensor(lens).numpy(), size)
        variants = {"pick": (picked, ta.DEFAULT_DECODE_CONFIG),
                    "pick-n128": (picked, ta.DecodeConfig(block_n=128))}
        variants.update({f"s{s}": (s, ta.DEFAULT_DECODE_CONFIG) for s in FORCED})
        sets = [make_batch(lens, gen, device) for _ in range(3)]
        ref = paged_attention_ref(*sets[0], SCALE)
        nbytes = sum(lens) * NUM_KV_HEADS * HEAD_DIM * 2 * 2 + 2 * len(lens) * NUM_HEADS * HEAD_DIM * 2
        warm = [(lambda s=s: ta.paged_attention_triton(*s, SCALE)) for s in sets]
        cuda_timing.time_graph(warm, 20, "cuda")  # the first timing of a case runs slow
        for name, (splits, dcfg) in variants.items():
            outs = [torch.empty_like(s[0]) for s in sets]
            ta.paged_attention_triton(*sets[0], SCALE, out=outs[0], decode_config=dcfg, num_splits=splits)
            err = (outs[0].float() - ref.float()).abs().max().item()
            assert err < 3e-2, (t, name, err)
            calls = [(lambda s=s, o=o: ta.paged_attention_triton(*s, SCALE, out=o, decode_config=dcfg,
                                                                 num_splits=splits))
                     for s, o in zip(sets, outs)]
            ms = cuda_timing.time_graph(calls, 20, "cuda")
            pct = 100 * nbytes / (ms * 1e-3) / copy_bw
            rows.append(dict(tree=label, step=t, rows=len(lens), ctx=sum(lens), variant=name, splits=splits,
                             us=ms * 1e3, pct_copy=pct))
            print(f"| {label} | {t} | {len(lens)} | {sum(lens)} | {name} | {splits} | {ms * 1e3:.1f} | {pct:.1f} |",
                  flush=True)
        del sets
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"decode_small256_{label}.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=triton.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
