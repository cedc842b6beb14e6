#!/usr/bin/env python
"""Paged attention on small-256's own batches (Qwen3-0.6B shape: 16 q heads, 8 KV heads,
head_dim 128, bf16, block_size 16, block tables in random order), one CUDA GPU.

    python benchmarks/bench_attention_small256.py [--tree DIR] [--out DIR] [--label NAME]
        [--decode NAME:k=v,...] [--prefill NAME:k=v,...] [--stages decode,mixed] [--budget N]

decode: after the prompts are in, decode step t holds the requests with max_tokens > t,
each at context prompt_len + t + 1.  For several t, one layer's decode attention is timed
as the runner runs it (`runner`: its split pick, rows longest first), with other kernel
configs at the same split count (--decode, DecodeConfig fields), and with forced split
counts (`sN`), and with other KV cache layouts (`LAYOUTS`: block size, and a KV head's
tokens of a block contiguous).  % of copy: K/V bytes over the time, against 4.26 TB/s.

mixed: the prefill phase's steps as the scheduler builds them (running rows first: one
token for a decode, a chunk for a prompt; then prompts first-come first-served, all within
`--budget` tokens, 16,384 by default as in the engine on the H200); every other one is
timed.  Each step's attention is timed as the runner runs it (the prefill kernel
skipping single-token rows, then the decode kernel over those rows), and its two kernels
alone; the prefill kernel with other configs too (--prefill, PrefillConfig fields).
TFLOP/s of the prefill kernel: 4 x head_dim x q heads x causal query-key pairs.

`--tree DIR` imports slipstream from another source tree (an A/B of two versions in one
call: the tree needs the API used here, `triton_attention.prefill_attention` /
`decode_attention` included).  Timing: every call captured with the same call on
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

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from slipstream.bench import cuda_timing  # noqa: E402
from slipstream.ops import triton_attention as ta  # noqa: E402
from slipstream.ops.attention import paged_attention_ref  # noqa: E402
from slipstream.ops.metadata import AttentionMetadata  # noqa: E402
from slipstream.ops.device import sm_count  # noqa: E402
from slipstream.runner.graphs import capture_sizes  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, MAX_LEN = 16, 8, 128, 16, 2048
DTYPE = torch.bfloat16
SCALE = HEAD_DIM ** -0.5
COPY_BW, MATMUL = 4.26e12, 792e12  # design brief §5
STEPS = (20, 150, 300, 450, 600, 750, 900, 980)
FORCED = (1, 2, 3, 4)
MIXED_EVERY = 2  # every other step with prompt tokens is timed
BUDGET = 16384  # tokens a step: the engine's default on the H200 (config.default_max_num_batched_tokens)
# (batches of more than large_batch rows run large_block_n / large_num_warps: by default
# 32-token tiles, 2 stages, one warp; "L-*" name the large-batch tiles a variant runs)
DECODE_VARIANTS = {"always-n64w4": "large_batch=1000", "always-n32w1": "large_batch=0",
                   "L-n32s3w1": "num_stages=3", "L-n32s2w2": "large_num_warps=2",
                   "L-n16s4w1": "large_block_n=16,num_stages=4", "L-n64s2w1": "large_block_n=64"}
# KV cache layouts: (block_size, heads outer) -- see make_batch
LAYOUTS = {"hnd64": (64, True)}
PREFILL_VARIANTS = {"narrow": "wide_n=0", "m128-wide128-w8": "block_m=128,num_warps=8,wide_n=128",
                    "m128-wide64-w8": "block_m=128,num_warps=8,wide_n=64", "m32": "block_m=32",
                    "m64-wide128": "wide_n=128"}


def workload() -> list[tuple[int, int]]:
    random.seed(0)
    return [(random.randint(100, 1024), random.randint(100, 1024)) for _ in range(256)]


def decode_lens(t: int) -> list[int]:
    return [p + t + 1 for p, m in workload() if m > t]


def mixed_steps(budget: int = BUDGET) -> list[tuple[list[int], list[int]]]:
    """(seq_lens, query_lens) of the steps that hold prompt tokens, as the scheduler
    builds them (one token per decode row a step; the output tokens do not matter here)."""
    prompts = [p for p, _ in workload()]
    waiting, running, steps = list(range(len(prompts))), [], []
    done = [0] * len(prompts)  # KV tokens computed
    while waiting or any(done[r] < prompts[r] for r in running):
        left, lens, qlens = budget, [], []
        for r in running:
            if left <= 0:
                break
            n = min(prompts[r] - done[r], left) if done[r] < prompts[r] else 1
            lens.append(done[r] + n)
            qlens.append(n)
            done[r] += n
            left -= n
        while waiting and left > 0 and len(running) < 256:
            r = waiting.pop(0)
            n = min(prompts[r], left)
            running.append(r)
            lens.append(n)
            qlens.append(n)
            done[r] = n
            left -= n
        steps.append((lens, qlens))
    return steps


def make_batch(lens, qlens, gen, device, block_size=BLOCK_SIZE, heads_outer=False):
    """`heads_outer`: the caches are allocated [blocks, kv_heads, block_size, head_dim] (a
    KV head's tokens of a block contiguous) and passed as the usual [blocks, block_size,
    kv_heads, head_dim] view; the kernels address the caches through their strides."""
    blocks = [triton.cdiv(s, block_size) for s in lens]
    num_blocks = sum(blocks) + 1
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    bt = torch.zeros((len(lens), triton.cdiv(MAX_LEN, block_size)), dtype=torch.int32)
    i = 0
    for r, nb in enumerate(blocks):
        bt[r, :nb] = perm[i:i + nb]
        i += nb
    if heads_outer:
        shape = (num_blocks, NUM_KV_HEADS, block_size, HEAD_DIM)
        k = torch.randn(shape, device=device, dtype=DTYPE).transpose(1, 2)
        v = torch.randn(shape, device=device, dtype=DTYPE).transpose(1, 2)
    else:
        shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
        k = torch.randn(shape, device=device, dtype=DTYPE)
        v = torch.randn(shape, device=device, dtype=DTYPE)
    n = len(lens)
    qsl = np.zeros(n + 1, np.int32)
    np.cumsum(qlens, out=qsl[1:])
    q = torch.randn((int(qsl[-1]), NUM_HEADS, HEAD_DIM), device=device, dtype=DTYPE)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    single = np.asarray(qlens) == 1
    # the runner's order: single-token rows longest first, then the others
    idx = np.flatnonzero(single)
    order = np.concatenate([idx[np.argsort(-np.asarray(lens)[idx], kind="stable")], np.flatnonzero(~single)])
    meta = AttentionMetadata(
        query_start_loc=torch.from_numpy(qsl).to(device), seq_lens=seq_lens.to(device), block_table=bt.to(device),
        slot_mapping=torch.full((int(qsl[-1]),), -1, dtype=torch.int32, device=device),
        max_query_len=max(qlens), max_seq_len=MAX_LEN,  # the graphs' bound, as the runner passes it
        decode_order=torch.from_numpy(order.astype(np.int32)).to(device),
        split_counters=torch.zeros(n * NUM_KV_HEADS, dtype=torch.int32, device=device),
        num_decode=int(single.sum()) if max(qlens) > 1 else 0)
    return q, k, v, meta


def timed(sets, fn) -> float:
    """Median microseconds of fn(q, k, v, meta, out) over the rotating sets."""
    outs = [torch.empty_like(s[0]) for s in sets]
    calls = [(lambda s=s, o=o: fn(*s, o)) for s, o in zip(sets, outs)]
    return cuda_timing.time_graph(calls, 20, "cuda") * 1e3


def check(sets, fn, name, ref):
    """fn on the first set against `ref`, that set's `paged_attention_ref` output."""
    out = torch.empty_like(sets[0][0])
    fn(*sets[0], out)
    err = (out.float() - ref.float()).abs().max().item()
    assert err < 3e-2, (name, err)


def bench_decode(decode_variants, gen, device, label, rows):
    policy_cfg = ta.effective_decode_config(ta.DEFAULT_DECODE_CONFIG, DTYPE, HEAD_DIM)
    policy = ta.DecodeSplitPolicy(NUM_KV_HEADS, MAX_LEN, policy_cfg, sm_count(device))
    print("| tree | step | rows | variant | splits | us | % of copy |\n|---|---|---|---|---|---|---|")
    for t in STEPS:
        lens = decode_lens(t)
        size = next(s for s in capture_sizes(256) if s >= len(lens))
        picked = policy.pick(np.array(lens), size)
        variants = {"runner": (ta.DEFAULT_DECODE_CONFIG, picked, None)}
        variants.update({name: (cfg, picked, None) for name, cfg in decode_variants.items()})
        variants.update({name: (ta.DEFAULT_DECODE_CONFIG, picked, layout) for name, layout in LAYOUTS.items()})
        variants.update({f"s{s}": (ta.DEFAULT_DECODE_CONFIG, s, None) for s in FORCED})
        sets = [make_batch(lens, [1] * len(lens), gen, device) for _ in range(3)]
        nbytes = sum(lens) * NUM_KV_HEADS * HEAD_DIM * 2 * 2
        ref = paged_attention_ref(*sets[0], SCALE)  # once per case: the slow part of the checks
        timed(sets, lambda q, k, v, m, o: ta.paged_attention_triton(q, k, v, m, SCALE, out=o))  # warm-up
        for name, (cfg, splits, layout) in variants.items():
            fn = (lambda q, k, v, m, o, cfg=cfg, splits=splits: ta.paged_attention_triton(
                q, k, v, m, SCALE, out=o, decode_config=cfg, num_splits=splits))
            if layout is None:
                vsets, vref = sets, ref
            else:
                vsets = [make_batch(lens, [1] * len(lens), gen, device, *layout) for _ in range(3)]
                vref = paged_attention_ref(*vsets[0], SCALE)
            check(vsets, fn, name, vref)
            us = timed(vsets, fn)
            del vsets, vref
            pct = 100 * nbytes / (us * 1e-6) / COPY_BW
            rows.append(dict(stage="decode", tree=label, step=t, rows=len(lens), variant=name, splits=splits,
                             us=us, pct_copy=pct))
            print(f"| {label} | {t} | {len(lens)} | {name} | {splits} | {us:.1f} | {pct:.1f} |", flush=True)
        del sets


def bench_mixed(prefill_variants, gen, device, label, rows, budget):
    steps = mixed_steps(budget)
    print(f"\n{len(steps)} steps with prompt tokens ({budget} tokens a step)")
    print("| tree | step | rows | decode rows | prompt tokens | part | variant | us | TFLOP/s or % of copy |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for i in range(0, len(steps), MIXED_EVERY):
        lens, qlens = steps[i]
        sets = [make_batch(lens, qlens, gen, device) for _ in range(3)]
        meta = sets[0][3]
        ndec = meta.num_decode
        pairs = sum(q * (s - q) + q * (q + 1) // 2 for s, q in zip(lens, qlens) if q > 1)
        flops = 4 * HEAD_DIM * NUM_HEADS * pairs
        dec_bytes = sum(s for s, q in zip(lens, qlens) if q == 1) * NUM_KV_HEADS * HEAD_DIM * 4
        prompt_tokens = sum(q for q in qlens if q > 1)
        parts = {("all", "runner"): lambda q, k, v, m, o: ta.paged_attention_triton(q, k, v, m, SCALE, out=o),
                 ("prefill", "runner"): lambda q, k, v, m, o: ta.prefill_attention(
                     q, k, v, m, SCALE, o, skip_single=True)}
        parts.update({("prefill", name): (lambda q, k, v, m, o, cfg=cfg: ta.prefill_attention(
            q, k, v, m, SCALE, o, cfg, skip_single=True)) for name, cfg in prefill_variants.items()})
        if ndec:
            parts[("decode", "runner")] = lambda q, k, v, m, o: ta.decode_attention(
                q, k, v, m, SCALE, o, num_rows=m.num_decode)
        check(sets, parts[("all", "runner")], "mixed", paged_attention_ref(*sets[0], SCALE))
        hnd = [make_batch(lens, qlens, gen, device, BLOCK_SIZE, True) for _ in range(3)]
        parts[("all", "hnd16")] = parts[("all", "runner")]
        for (part, name), fn in parts.items():
            us = timed(hnd if name == "hnd16" else sets, fn)
            perf = (f"{flops / (us * 1e-6) / 1e12:.0f} TFLOP/s" if part == "prefill" else
                    f"{100 * dec_bytes / (us * 1e-6) / COPY_BW:.1f}% copy" if part == "decode" else "")
            rows.append(dict(stage="mixed", tree=label, step=i, rows=len(lens), decode_rows=ndec,
                             prompt_tokens=prompt_tokens, part=part, variant=name, us=us,
                             flops=flops, decode_bytes=dec_bytes))
            print(f"| {label} | {i} | {len(lens)} | {ndec} | {prompt_tokens} | {part} | {name} | {us:.1f} | {perf} |",
                  flush=True)
        del sets, hnd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", help="import slipstream from this source tree")
    ap.add_argument("--out", help="write attention_small256_LABEL.json here")
    ap.add_argument("--label", default="", help="a name for this tree in the tables")
    ap.add_argument("--decode", action="append", default=[], metavar="NAME:k=v,...")
    ap.add_argument("--prefill", action="append", default=[], metavar="NAME:k=v,...")
    ap.add_argument("--stages", default="decode,mixed")
    ap.add_argument("--budget", type=int, default=BUDGET, help="tokens a step (max_num_batched_tokens)")
    ap.add_argument("--no-variants", action="store_true", help="only the runner's configs and forced splits")
    args = ap.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    label = args.label or os.path.basename(_tree())
    decode_specs = {} if args.no_variants else dict(DECODE_VARIANTS)
    prefill_specs = {} if args.no_variants else dict(PREFILL_VARIANTS)
    decode_specs.update(s.split(":", 1) for s in args.decode)
    prefill_specs.update(s.split(":", 1) for s in args.prefill)
    from bench_attention import parse_variant  # (this script's folder is on sys.path)
    decode_variants = {n: parse_variant(f"{n}:{s}", ta.DecodeConfig)[1] for n, s in decode_specs.items()}
    prefill_variants = {n: parse_variant(f"{n}:{s}", ta.PrefillConfig)[1] for n, s in prefill_specs.items()}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, tree {label}")
    rows: list[dict] = []
    if "decode" in args.stages:
        bench_decode(decode_variants, gen, device, label, rows)
    if "mixed" in args.stages:
        bench_mixed(prefill_variants, gen, device, label, rows, args.budget)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"attention_small256_{label}.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=triton.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
