"""The cost of speculative decoding's verification step against a plain decode step.

On the Llama-3.1-8B and Qwen3-0.6B shapes (dummy bf16 weights, random KV, a context of
--context tokens a row), at 1, 8 and 32 rows and k = 1..7 drafts a row: the runner's padded
verify step (`runner.speculative.verify_step`: the forward over rows x (k + 1) tokens with
the verify attention kernel, the LM head on every verified position, the acceptance on the
device) against the plain decode step of the same rows
(`ModelRunner.compute_step`: forward, LM head, sampler), both timed as CUDA graphs (median of
replays, slipstream/bench/cuda_timing.py).  Prints a table of ratios (the target at 1 row,
k <= 4: <= 1.15), and the forward alone of both (its layers' GEMMs take k + 1 rows: cuBLAS,
where one row takes the GEMV), and writes bench_verify_step.json with --out.

`--device cpu --tiny`: a tiny random Llama on the CPU, timed eagerly (a smoke run of the
whole path; its numbers mean nothing).

`--blas cublaslt` (or `cublas`) sets torch's preferred BLAS library for the run: both steps'
cuBLAS products (the verify step's k + 1 rows, a plain step past the GEMV's rows) then go
through that library, an A/B of the few-row GEMMs without a change to the engine.

Usage: python benchmarks/bench_verify_step.py [--out DIR] [--models llama-3.1-8b qwen3-0.6b]
       [--rows 1 8 32] [--ks 1 2 3 4 5 6 7] [--context 512] [--blas default|cublas|cublaslt]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from slipstream.bench.cuda_timing import time_graph  # noqa: E402
from slipstream.bench.report import write_json  # noqa: E402
from slipstream.bench.workloads import CONFIGS  # noqa: E402
from slipstream.config import EngineConfig  # noqa: E402
from slipstream.core.engine_core import EngineCore  # noqa: E402
from slipstream.runner.inputs import StepPad, StepShape  # noqa: E402
from slipstream.runner.speculative import spec_buffers, verify_step  # noqa: E402
from slipstream.runner.verify_graphs import verify_inputs  # noqa: E402
from slipstream.sampling.sampler import SamplerFlags  # noqa: E402

TARGET = 1.15  # verify / plain at 1 row, k <= 4 (issue 45)
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32"}
PLAIN = SamplerFlags(False, False, 0)


def fill(runner, slot, rows: int, q_len: int, ctx: int, k: int) -> StepShape:
    """`rows` rows of q_len new tokens each (1: a decode step; k + 1: a verify step with k
    drafts a row), the newest at position ctx - 1, each row on its own blocks; greedy."""
    h, bs = slot.host, runner.block_size
    per_seq = -(-ctx // bs)
    T = rows * q_len
    runner.fill_padding(slot, StepShape.padded_to(StepPad(rows, rows), True, PLAIN, runner.max_model_len))
    seq = np.repeat(np.arange(rows), q_len)
    pos = ctx - q_len + np.tile(np.arange(q_len), rows)
    blocks = np.arange(rows * per_seq, dtype=np.int32).reshape(rows, per_seq)
    h.input_ids[:T] = np.random.default_rng(0).integers(0, runner.model_config.vocab_size, T)
    h.positions[:T] = pos
    h.slot_mapping[:T] = blocks[seq, pos // bs] * bs + pos % bs
    h.carry_idx[:T] = -1
    h.query_start_loc[:rows + 1] = np.arange(rows + 1) * q_len
    h.seq_lens[:rows] = ctx
    h.decode_order[:rows] = np.arange(rows)
    h.block_table[:rows, :per_seq] = blocks
    h.logits_indices[:rows] = (np.arange(rows) + 1) * q_len - 1
    slot.upload(rows)
    if q_len == 1:
        return StepShape(rows, rows, rows, 1, runner.max_model_len, PLAIN, padded=True)
    vin = verify_inputs(runner, slot.index, k)
    vin.host[:rows, :k] = torch.as_tensor(h.input_ids[:T].reshape(rows, q_len)[:, 1:])
    vin.host[:rows, k] = k
    vin.host[:rows, k + 1] = k
    vin.dev[:rows].copy_(vin.host[:rows])
    return StepShape(T, rows, rows, q_len, runner.max_model_len, PLAIN, padded=True, verify_len=q_len)


def measure(runner, rows: int, ks: list[int], ctx: int, device: str, iters: int) -> list[dict]:
    slot = runner.slots[0]
    out = []
    with torch.inference_mode():
        shape = fill(runner, slot, rows, 1, ctx, 0)
        plain = time_graph([lambda: runner.compute_step(slot, shape)], iters, device)
        plain_fwd = time_graph([lambda: runner.forward_hidden(slot, shape)], iters, device)
        for k in ks:
            vshape = fill(runner, slot, rows, k + 1, ctx, k)
            bufs, vin = spec_buffers(runner, slot.index, k), verify_inputs(runner, slot.index, k)
            verify = time_graph([lambda: verify_step(runner, slot, vshape, bufs, vin, None)], iters, device)
            # the forward alone (layers, no LM head): what k + 1 rows cost the GEMMs and attention
            fwd = time_graph([lambda: runner.forward_hidden(slot, vshape)], iters, device)
            out.append({"rows": rows, "k": k, "plain_ms": plain, "verify_ms": verify, "ratio": verify / plain,
                        "plain_forward_ms": plain_fwd, "verify_forward_ms": fwd, "forward_ratio": fwd / plain_fwd})
    return out


def engine(model: str, device: str, max_rows: int, ctx: int, max_k: int) -> EngineCore:
    cfg = EngineConfig(model=model, load_format="dummy", device=device, max_num_seqs=max_rows,
                       max_model_len=ctx + 64, max_num_batched_tokens=max(2048, max_rows * (max_k + 1)),
                       enforce_eager=True, enable_prefix_caching=False)
    core = EngineCore(cfg)
    for k_cache, v_cache in core.runner.kv_caches:  # random KV: zeros can run faster than data
        k_cache.normal_()
        v_cache.normal_()
    return core


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", nargs="+", default=["llama-3.1-8b", "qwen3-0.6b"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--ks", nargs="+", type=int, default=list(range(1, 8)))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of --models (smoke runs)")
    ap.add_argument("--blas", choices=["default", "cublas", "cublaslt"], default="default",
                    help="torch's preferred BLAS library for the run (default: torch's own choice)")
    args = ap.parse_args(argv)
    if args.blas != "default":
        if args.device != "cuda":
            ap.error(f"--blas {args.blas} needs --device cuda")
        torch.backends.cuda.preferred_blas_library(args.blas)
    if args.tiny:
        tmp = tempfile.mkdtemp(prefix="verify-tiny-")
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(TINY, f)
        models = {"tiny": tmp}
    else:
        models = {m: os.path.join(CONFIGS, m) for m in args.models}
    res: dict = {"context": args.context, "device": args.device, "blas": args.blas, "results": {}}
    if args.device == "cuda":
        res["gpu"] = torch.cuda.get_device_name()
    for name, path in models.items():
        core = engine(path, args.device, max(args.rows), args.context, max(args.ks))
        rows = []
        for r in args.rows:
            rows += measure(core.runner, r, args.ks, args.context, args.device, args.iters)
        res["results"][name] = rows
        print(f"\n{name}, context {args.context}, BLAS {args.blas}: verify step / plain decode step (graph replays, median)")
        print("| rows | plain ms | " + " | ".join(f"k={k}" for k in args.ks) + " |")
        print("|---|---|" + "---|" * len(args.ks))
        for r in args.rows:
            cells = [x for x in rows if x["rows"] == r]
            print(f"| {r} | {cells[0]['plain_ms']:.3f} | " + " | ".join(f"{x['ratio']:.3f}" for x in cells) + " |")
        print("forward alone (no LM head, no sampling): verify / plain")
        print("| rows | plain forward ms | " + " | ".join(f"k={k}" for k in args.ks) + " |")
        print("|---|---|" + "---|" * len(args.ks))
        for r in args.rows:
            cells = [x for x in rows if x["rows"] == r]
            print(f"| {r} | {cells[0]['plain_forward_ms']:.3f} | "
                  + " | ".join(f"{x['forward_ratio']:.3f}" for x in cells) + " |")
        one = [x["ratio"] for x in rows if x["rows"] == 1 and x["k"] <= 4]
        if one:
            print(f"1 row, k <= 4: worst {max(one):.3f} x (target <= {TARGET})")
        del core
    if args.out:
        write_json(args.out, "bench_verify_step.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
