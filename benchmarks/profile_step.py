"""Where a decode step's time goes: per-kernel times of the production CUDA graph.

For each case (model shape, batch, context) it replays the captured decode graph under
torch.profiler and prints, per step: the wall time, the sum of kernel times (the rest
is gaps between kernels), and the kernels grouped by kind with their count per step.

Usage: python benchmarks/profile_step.py [--out DIR] [--case MODEL:BATCH:CONTEXT[:fp8] ...]
(the default cases below when no --case is given)
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_step import fill_decode, time_fn  # noqa: E402

from slipstream.bench.report import write_json  # noqa: E402
from slipstream.bench.workloads import CONFIGS  # noqa: E402
from slipstream.config import EngineConfig  # noqa: E402
from slipstream.core.engine_core import EngineCore  # noqa: E402
from slipstream.runner.inputs import StepPad, StepShape  # noqa: E402
from slipstream.sampling.sampler import SamplerFlags  # noqa: E402

CASES = [("llama-3.1-8b", 32, 1024), ("llama-3.1-8b", 32, 4096), ("qwen3-0.6b", 256, 1024), ("qwen3-0.6b", 48, 1024)]
# A name's kind is the first whose keys one of its substrings is.  "spec": n-gram drafting, the
# device drafter's row shift, drafts and their rejection (a drafter's own forward is gemm,
# attention, ... like the target's: benchmarks/profile_bench.py tells them apart by range);
# "mask": a grammar bitmask applied apart from the sampling kernel; "memcpy": the copy engines'
# transfers. The aten:: names are the CPU's ops (profile_bench.py's CPU runs).
KINDS = [("spec", ("ngram", "shift_kernel", "draft", "reject", "accept")),
         ("mask", ("bitmask", "apply_token_mask")),
         ("moe", ("moe", "expert", "route", "small_gate", "small_down", "align", "topk")),
         ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm")),
         ("attention", ("attn", "decode", "prefill", "verify_kernel", "verify_reduce", "attention")),
         ("norm", ("rms",)), ("rope/kv", ("rope", "store", "qkv_epilogue")), ("silu", ("silu",)),
         ("sampler", ("sample", "gumbel", "argmax")), ("memcpy", ("memcpy", "memset")),
         ("copy/index", ("copy", "index", "where", "gather", "scatter", "fill"))]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def profile_case(model: str, batch: int, context: int, quantization: str = "none", reps: int = 5) -> dict:
    cfg = EngineConfig(model=os.path.join(CONFIGS, model), load_format="dummy", device="cuda", max_num_seqs=batch,
                       quantization=quantization,
                       max_model_len=context + 64, max_num_batched_tokens=max(2048, batch), enable_prefix_caching=False)
    engine = EngineCore(cfg)
    runner = engine.runner
    for k_cache, v_cache in runner.kv_caches:
        k_cache.normal_()
        v_cache.normal_()
    slot = runner.slots[0]
    fill_decode(runner, slot, batch, context)
    shape = StepShape.padded_to(StepPad(batch, batch), True, SamplerFlags(False, False, 0), runner.max_model_len,
                                runner.decode_splits(slot.host, batch, batch))
    step = time_fn(lambda: runner.replay(slot, shape), 20)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            runner.replay(slot, shape)
        torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[ev.name]
            k[0] += 1
            k[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    total_us = sum(v[1] for v in kernels.values()) / reps
    by_kind = collections.defaultdict(lambda: [0.0, 0.0])
    for name, (count, us) in kernels.items():
        by_kind[kind_of(name)][0] += count / reps
        by_kind[kind_of(name)][1] += us / reps
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:20]
    engine = runner = None  # (the lambda above holds runner: let both go before empty_cache)
    torch.cuda.empty_cache()
    return {"model": model, "quantization": quantization, "batch": batch, "context": context, "step_us": step * 1e6, "kernel_us": total_us,
            "kernels_per_step": sum(v[0] for v in kernels.values()) / reps,
            "by_kind": {k: {"per_step": c, "us": u} for k, (c, u) in by_kind.items()},
            "top": [(n[:90], c / reps, u / reps) for n, (c, u) in top]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--case", action="append", default=[], help="MODEL:BATCH:CONTEXT, e.g. qwen3-0.6b:1:512")
    args = ap.parse_args()
    cases = [(p[0], int(p[1]), int(p[2]), p[3] if len(p) > 3 else "none")
             for p in (case.split(":") for case in args.case)] or [c + ("none",) for c in CASES]
    results = []
    for model, batch, context, quantization in cases:
        r = profile_case(model, batch, context, quantization)
        results.append(r)
        print(f"\n## {model} ({quantization}) batch {batch} context {context}: step {r['step_us']:.0f} us, kernels {r['kernel_us']:.0f} us "
              f"({r['kernels_per_step']:.0f} kernels), gaps {r['step_us'] - r['kernel_us']:.0f} us")
        print("| kind | kernels/step | us/step |\n|---|---|---|")
        for kind, v in sorted(r["by_kind"].items(), key=lambda kv: -kv[1]["us"]):
            print(f"| {kind} | {v['per_step']:.0f} | {v['us']:.0f} |")
        for name, count, us in r["top"]:
            print(f"  {us:8.0f} us  x{count:4.0f}  {name}")
    if args.out:
        write_json(args.out, "profile_step.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
