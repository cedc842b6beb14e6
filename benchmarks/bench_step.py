"""Engine steps on the Llama-3.1-8B shape (or `--model`; dummy bf16 weights), on the GPU.

1. A decode step at batch 32, context 4096: the production CUDA graph (carry-over,
   forward, logits, sampling) replayed from slot 0, against the floor
   (weights + KV bytes) / copy bandwidth.
2. A prefill of 8 x 2048 tokens (eager forward + logits), in TFLOP/s against the
   measured bf16 matmul rate.
3. VRAM of the CUDA-graph pool with the graphs of one slot, then of both slots (decode
   graphs up to the batch, mixed-step graphs up to 2,048 tokens).

Usage: python benchmarks/bench_step.py [--out DIR] [--model qwen3-0.6b --batch 48 --context 1024]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from slipstream.bench.run import environment  # noqa: E402
from slipstream.bench.report import write_json  # noqa: E402
from slipstream.bench.throughput import measure_ceilings  # noqa: E402
from slipstream.bench.workloads import CONFIGS  # noqa: E402
from slipstream.config import EngineConfig  # noqa: E402
from slipstream.core.engine_core import EngineCore  # noqa: E402
from slipstream.runner.graphs import StepGraphs, capture_sizes, mixed_token_sizes  # noqa: E402
from slipstream.runner.inputs import StepPad, StepShape, sampling_scalars  # noqa: E402
from slipstream.sampling.sampler import SamplerFlags  # noqa: E402

MiB = 1 << 20


def fill_decode(runner, slot, bs: int, ctx: int) -> None:
    """A decode batch of `bs` rows at context `ctx` (greedy), each row on its own blocks."""
    runner.fill_padding(slot, decode_shape(runner, bs))  # neutral sampling parameters, no carry-over
    h, bsz = slot.host, runner.block_size
    per_seq = -(-ctx // bsz)
    h.input_ids[:bs] = np.random.default_rng(0).integers(0, 128000, bs)
    h.positions[:bs] = ctx - 1
    blocks = np.arange(bs * per_seq, dtype=np.int32).reshape(bs, per_seq)
    h.block_table[:bs, :per_seq] = blocks
    h.slot_mapping[:bs] = blocks[:, (ctx - 1) // bsz] * bsz + (ctx - 1) % bsz
    h.seq_lens[:bs] = ctx
    slot.upload(bs)
    torch.cuda.synchronize()


def decode_shape(runner, bs: int) -> StepShape:
    return StepShape.padded_to(StepPad(bs, bs), True, SamplerFlags(False, False, 0), runner.max_model_len)


def fill_prefill(runner, slot, num_seqs: int, length: int) -> StepShape:
    h, bsz = slot.host, runner.block_size
    per_seq = -(-length // bsz)
    T = num_seqs * length
    rng = np.random.default_rng(1)
    h.input_ids[:T] = rng.integers(0, 128000, T)
    pos = np.tile(np.arange(length), num_seqs)
    seq = np.repeat(np.arange(num_seqs), length)
    blocks = np.arange(num_seqs * per_seq, dtype=np.int32).reshape(num_seqs, per_seq)
    h.positions[:T] = pos
    h.slot_mapping[:T] = blocks[seq, pos // bsz] * bsz + pos % bsz
    h.carry_idx[:T] = -1
    h.query_start_loc[:num_seqs + 1] = np.arange(num_seqs + 1) * length
    h.seq_lens[:num_seqs] = length
    h.block_table[:num_seqs, :per_seq] = blocks
    h.logits_indices[:num_seqs] = (np.arange(num_seqs) + 1) * length - 1
    h.state_row[:num_seqs] = runner.opts.max_num_seqs
    h.temperature[:num_seqs] = 0.0
    h.top_p[:num_seqs] = 1.0
    sampling_scalars(h, num_seqs)
    slot.upload(num_seqs)
    torch.cuda.synchronize()
    return StepShape(T, num_seqs, num_seqs, length, length, SamplerFlags(False, False, 0), padded=False)


def time_fn(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return float(np.median(times))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--model", default="llama-3.1-8b", help="a config under slipstream/bench/configs")
    args = ap.parse_args()
    bw, rate = measure_ceilings(torch.device("cuda"))
    cfg = EngineConfig(model=os.path.join(CONFIGS, args.model), load_format="dummy", device="cuda",
                       max_num_seqs=args.batch, max_model_len=args.context + 64, max_num_batched_tokens=16384,
                       enforce_eager=True, enable_prefix_caching=False)
    engine = EngineCore(cfg)
    runner, c = engine.runner, engine.model_config
    res: dict = {"env": environment(), "copy_bandwidth": bw, "matmul_rate": rate}

    # 3. VRAM of the graph pool: one slot's graphs, then both slots'.
    graphs = StepGraphs(capture_sizes(args.batch), mixed_token_sizes(2048), args.batch, runner.max_model_len)
    torch.cuda.synchronize()
    base = torch.cuda.memory_reserved()
    graphs.capture_all(runner, slots=[runner.slots[0]])
    torch.cuda.synchronize()
    one = torch.cuda.memory_reserved()
    graphs.capture_all(runner, slots=[runner.slots[1]])
    torch.cuda.synchronize()
    two = torch.cuda.memory_reserved()
    res["vram_graphs_one_slot_mib"] = (one - base) / MiB
    res["vram_graphs_two_slots_mib"] = (two - base) / MiB
    runner.graphs = graphs

    # 1. decode step (over random KV: zeros can run faster than real data)
    for k_cache, v_cache in runner.kv_caches:
        k_cache.normal_()
        v_cache.normal_()
    slot = runner.slots[0]
    fill_decode(runner, slot, args.batch, args.context)
    shape = decode_shape(runner, args.batch)
    step = time_fn(lambda: graphs.replay(0, shape), 30)
    elem = 2
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    weights = (c.num_layers * (c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
               + c.vocab_size * c.hidden_size) * elem
    kv_bytes = args.batch * args.context * 2 * c.num_layers * kv * elem
    floor = (weights + kv_bytes) / bw
    res["decode"] = {"batch": args.batch, "context": args.context, "step_ms": step * 1e3, "floor_ms": floor * 1e3,
                     "ratio": step / floor, "weights_gb": weights / 1e9, "kv_gb": kv_bytes / 1e9}
    eager = time_fn(lambda: runner.compute_step(slot, shape), 10)
    res["decode"]["eager_step_ms"] = eager * 1e3

    # 2. prefill 8 x 2048 (8 x the context when it is shorter)
    plen = min(2048, args.context)
    pshape = fill_prefill(runner, slot, 8, plen)
    with torch.inference_mode():
        pre = time_fn(lambda: runner.forward(slot, pshape), 5)
    tokens = 8 * plen
    matmul_params = weights / elem - c.vocab_size * c.hidden_size
    flops = 2 * matmul_params * tokens + 2 * c.vocab_size * c.hidden_size * 8 + 4 * c.num_layers * q * 8 * (plen * (plen + 1) / 2)
    res["prefill"] = {"tokens": tokens, "ms": pre * 1e3, "tflops": flops / pre / 1e12, "fraction_of_matmul_rate": flops / pre / rate}

    d, p = res["decode"], res["prefill"]
    print("| measurement | value | target |\n|---|---|---|")
    print(f"| copy bandwidth | {bw / 1e12:.2f} TB/s | |")
    print(f"| bf16 matmul 8192^3 | {rate / 1e12:.0f} TFLOP/s | |")
    print(f"| decode step b{args.batch} ctx{args.context} (graph) | {d['step_ms']:.2f} ms = {d['ratio']:.3f} x floor {d['floor_ms']:.2f} ms | <= 1.2 x |")
    print(f"| decode step eager | {d['eager_step_ms']:.2f} ms | |")
    print(f"| prefill 8x{plen} | {p['ms']:.1f} ms, {p['tflops']:.0f} TFLOP/s = {100 * p['fraction_of_matmul_rate']:.0f}% | >= 60% |")
    print(f"| graph pool VRAM | one slot {res['vram_graphs_one_slot_mib']:.0f} MiB, two slots {res['vram_graphs_two_slots_mib']:.0f} MiB | flat |")
    if args.out:
        write_json(args.out, "bench_step.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
