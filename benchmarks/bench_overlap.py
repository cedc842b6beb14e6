"""Experiment: does splitting a decode batch in two halves on two streams hide the small
kernels' fixed costs under the other half's attention?

On the Qwen3-0.6B shape (dummy weights) at ragged contexts, each variant's forward +
logits is captured in one CUDA graph and timed (median of replays, `cuda_timing.time_graph`):
  one        the whole batch, one stream (what the engine runs);
  halves     two halves on two streams, forked and joined inside the graph;
  staggered  the same, with half B's layer i waiting for half A's layer i, so the
             halves run one layer apart (A's attention meets B's GEMMs).

Usage: python benchmarks/bench_overlap.py [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from slipstream.bench.cuda_timing import time_graph  # noqa: E402
from slipstream.bench.report import write_json  # noqa: E402
from slipstream.bench.workloads import CONFIGS  # noqa: E402
from slipstream.config import EngineConfig  # noqa: E402
from slipstream.core.engine_core import EngineCore  # noqa: E402
from slipstream.ops.metadata import AttentionMetadata  # noqa: E402
from slipstream.ops.fused import rms_norm  # noqa: E402


class Half:
    """Device inputs of rows [lo, hi) of a decode batch, as their own batch."""

    def __init__(self, ids, pos, seq_lens, block_table, slot_mapping, max_len, kv_heads):
        n = ids.shape[0]
        dev = ids.device
        order = np.argsort(-seq_lens.cpu().numpy(), kind="stable").astype(np.int32)
        self.ids, self.pos = ids, pos
        self.meta = AttentionMetadata(torch.arange(n + 1, dtype=torch.int32, device=dev), seq_lens, block_table,
                                      slot_mapping, 1, max_len, decode_order=torch.from_numpy(order).to(dev),
                                      split_counters=torch.zeros(n * kv_heads, dtype=torch.int32, device=dev))


def layer_loop(model, half: Half, kv_caches, wait=None, signal=None):
    """The model's forward, layer by layer; `wait(i)` before layer i, `signal(i)` after it."""
    h = model.embed_tokens(half.ids)
    for i, (layer, kv) in enumerate(zip(model.layers, kv_caches)):
        if wait:
            wait(i)
        layer(h, half.pos, half.meta, kv, model.cos_sin_cache)
        if signal:
            signal(i)
    return model.compute_logits(rms_norm(h, model.norm.weight, model.config.rms_norm_eps))


def run_case(engine, bs: int, rng) -> dict:
    model, kv = engine.model, engine.runner.kv_caches
    c, dev, bsz = engine.model_config, engine.device, engine.runner.block_size
    ctx = rng.integers(200, 1800, bs)
    blocks_per = -(-ctx // bsz)
    table = np.zeros((bs, int(blocks_per.max())), dtype=np.int32)
    first = np.concatenate([[0], np.cumsum(blocks_per)[:-1]])
    for r in range(bs):
        table[r, :blocks_per[r]] = first[r] + np.arange(blocks_per[r])
    last = ctx - 1
    slots = table[np.arange(bs), last // bsz] * bsz + last % bsz
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a).astype(np.int32)).to(dev)  # noqa: E731
    ids, pos = t(rng.integers(0, 10000, bs)), t(last)
    seq_lens, block_table, slot_mapping = t(ctx), t(table), t(slots)
    max_len = engine.max_model_len
    full = Half(ids, pos, seq_lens, block_table, slot_mapping, max_len, c.num_kv_heads)
    h = bs // 2
    a = Half(ids[:h], pos[:h], seq_lens[:h], block_table[:h], slot_mapping[:h], max_len, c.num_kv_heads)
    b = Half(ids[h:], pos[h:], seq_lens[h:], block_table[h:], slot_mapping[h:], max_len, c.num_kv_heads)
    s_a, s_b = torch.cuda.Stream(), torch.cuda.Stream()
    events = [torch.cuda.Event() for _ in range(c.num_layers)]

    def two(stagger: bool):
        def fn():
            cur = torch.cuda.current_stream()
            s_a.wait_stream(cur)
            s_b.wait_stream(cur)
            with torch.cuda.stream(s_a):
                layer_loop(model, a, kv, signal=(lambda i: events[i].record()) if stagger else None)
            with torch.cuda.stream(s_b):
                layer_loop(model, b, kv, wait=(lambda i: s_b.wait_event(events[i])) if stagger else None)
            cur.wait_stream(s_a)
            cur.wait_stream(s_b)
        return fn

    variants = {"one": lambda: layer_loop(model, full, kv), "halves": two(False), "staggered": two(True)}
    times = {name: [] for name in variants}
    for _ in range(3):  # interleaved rounds: clock drift hits every variant alike
        for name, fn in variants.items():
            times[name].append(time_graph([fn], iters=30))
    kv_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2 * int(ctx.sum())
    return {"batch": bs, "mean_context": float(ctx.mean()), "kv_gb": kv_bytes / 1e9,
            "ms": {name: statistics.median(v) for name, v in times.items()}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = EngineConfig(model=os.path.join(CONFIGS, "qwen3-0.6b"), load_format="dummy", device="cuda",
                       max_num_seqs=256, max_model_len=2048, max_num_batched_tokens=2048,
                       enable_prefix_caching=False, enforce_eager=True)
    engine = EngineCore(cfg)
    for k_cache, v_cache in engine.runner.kv_caches:
        k_cache.normal_()
        v_cache.normal_()
    rng = np.random.default_rng(0)
    rows = []
    print("| batch | mean ctx | one | halves | staggered | halves/one | staggered/one |\n|---|---|---|---|---|---|---|")
    for bs in (256, 160, 96, 48):
        r = run_case(engine, bs, rng)
        ms = r["ms"]
        print(f"| {bs} | {r['mean_context']:.0f} | {ms['one']:.3f} ms | {ms['halves']:.3f} ms | "
              f"{ms['staggered']:.3f} ms | {ms['halves'] / ms['one']:.3f} | {ms['staggered'] / ms['one']:.3f} |")
        rows.append(r)
    if args.out:
        write_json(args.out, "bench_overlap.json", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
