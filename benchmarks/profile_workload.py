"""Where a workload's GPU time goes, by kind of kernel and by kind of step.

Runs a named workload in the sync loop (one batch in flight, so the kernels recorded
during a step are that step's own) and profiles the first 30 steps (the prefill phase of
the benchmark workloads) and every `--every`-th step after, under torch.profiler.  Steps are grouped as in `slipstream bench`
(prefill, decode by batch size); per group it prints the kernel time per step by kind
against two floors: attention against KV bytes / copy bandwidth, GEMMs against
max(weight bytes / copy bandwidth, matmul flops / matmul rate).

Usage: python benchmarks/profile_workload.py --workload small-256 [--every 10] [--out DIR]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from profile_step import kind_of  # noqa: E402

from slipstream.bench.report import write_json  # noqa: E402
from slipstream.bench.throughput import (COPY_BANDWIDTH, MATMUL_RATE, StepCosts, add_prompt,  # noqa: E402
                                         run_until_done, step_group)
from slipstream.core.tracing import Timeline  # noqa: E402
from slipstream.bench.workloads import get_workload  # noqa: E402
from slipstream.config import EngineConfig  # noqa: E402
from slipstream.core.engine_core import EngineCore  # noqa: E402
from slipstream.sampling.params import SamplingParams  # noqa: E402


def part_floors(costs: StepCosts, batch) -> tuple[float, float]:
    """(attention floor, GEMM floor) of one batch, in microseconds."""
    gemm = max(costs.weight_bytes / COPY_BANDWIDTH, costs.matmul_flops(batch) / MATMUL_RATE)
    return 1e6 * costs.kv_bytes(batch) / COPY_BANDWIDTH, 1e6 * gemm


def kernel_times(prof) -> dict[str, list[float]]:
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kinds[kind_of(ev.name)]
            k[0] += 1
            k[1] += ev.device_time_total
    return kinds


def profile_workload(name: str, every: int, device: str = "cuda") -> list[dict]:
    workload = get_workload(name)
    config = EngineConfig(model=workload.model, load_format="dummy", device=device, **workload.engine)
    engine = EngineCore(config)
    for i, (prompt, p) in enumerate(zip(workload.prompts, workload.params)):  # warm-up, as `slipstream bench`
        add_prompt(engine, f"warm-up-{i}", prompt,
                   SamplingParams(max_tokens=2, temperature=p.temperature, ignore_eos=True))
    run_until_done(engine)
    engine.set_async_scheduling(False)
    engine.reset_prefix_cache()
    timeline = Timeline()
    engine.loop.timeline = timeline
    for i, (prompt, params) in enumerate(zip(workload.prompts, workload.params)):
        add_prompt(engine, str(i), prompt, params)
    costs = StepCosts.of(engine.model_config, engine.dtype)
    steps, index = [], 0
    activities = [torch.profiler.ProfilerActivity.CUDA if engine.device.type == "cuda"
                  else torch.profiler.ProfilerActivity.CPU]  # CPU: a smoke run, no kernels
    while engine.has_work():
        before = len(timeline.batches)
        probe = index % every == 0 or index < 30  # the first steps hold every prefill chunk
        if probe:
            with torch.profiler.profile(activities=activities) as prof:
                engine.step()
                if engine.device.type == "cuda":
                    torch.cuda.synchronize()
        else:
            engine.step()
        index += 1
        if probe and len(timeline.batches) > before:
            b = timeline.batches[-1]
            attn_floor, gemm_floor = part_floors(costs, b)
            steps.append(dict(group=step_group(b), num_tokens=b.num_tokens,
                              attn_floor_us=attn_floor, gemm_floor_us=gemm_floor,
                              kinds={k: v for k, v in kernel_times(prof).items()}))
    return steps


def summarize(steps: list[dict]) -> list[dict]:
    groups: dict[str, list[dict]] = collections.defaultdict(list)
    for s in steps:
        groups[s["group"]].append(s)
    rows = []
    for group, members in groups.items():
        n = len(members)
        kinds = collections.defaultdict(lambda: [0.0, 0.0])
        for s in members:
            for k, (count, us) in s["kinds"].items():
                kinds[k][0] += count / n
                kinds[k][1] += us / n
        rows.append(dict(group=group, profiled=n, tokens=sum(s["num_tokens"] for s in members) / n,
                         attn_floor_us=sum(s["attn_floor_us"] for s in members) / n,
                         gemm_floor_us=sum(s["gemm_floor_us"] for s in members) / n,
                         kinds={k: {"per_step": c, "us": u} for k, (c, u) in kinds.items()}))
    return rows


def table(rows: list[dict]) -> str:
    names = ["attention", "gemm", "norm", "rope/kv", "silu", "moe", "spec", "mask", "sampler", "memcpy", "copy/index",
             "other"]  # (every kind of profile_step.KINDS: the kernel sum is theirs)
    out = ["| steps | profiled | tokens | kernels | attention / floor | gemm / floor | "
           + " | ".join(names[2:]) + " | kernel sum |", "|" + "---|" * (7 + len(names) - 2)]
    for r in rows:
        k = r["kinds"]
        us = {n: k.get(n, {"us": 0.0})["us"] for n in names}
        count = sum(v["per_step"] for v in k.values())
        out.append(f"| {r['group']} | {r['profiled']} | {r['tokens']:.0f} | {count:.0f} | "
                   f"{us['attention']:.0f} / {r['attn_floor_us']:.0f} | {us['gemm']:.0f} / {r['gemm_floor_us']:.0f} | "
                   + " | ".join(f"{us[n]:.0f}" for n in names[2:]) + f" | {sum(us.values()):.0f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="small-256")
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = summarize(profile_workload(args.workload, args.every, args.device))
    print(f"## {args.workload}: microseconds per step, by kind of kernel (sync loop, profiled steps)")
    print(table(rows))
    if args.out:
        write_json(args.out, f"profile_{args.workload}.json", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
