"""A workload through `AsyncLLM` (the core in its own process, or a thread), every request
submitted at once and every stream consumed, against the offline engine's figure.

  python benchmarks/bench_async_llm.py --workload small-256 [--core process|thread] [--out DIR]

Prints output tokens/s, wall, and the CPU seconds of the front-end process and of the core
process (from /proc), so one sees what the streams cost and where. Run it in the same call
as `slipstream bench --workload small-256 --mode async` for the ratio.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from slipstream import AsyncLLM, SamplingParams  # noqa: E402
from slipstream.bench.workloads import get_workload  # noqa: E402


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def consume(llm, prompt, params, rid) -> int:
    n = 0
    async for out in llm.generate(prompt, params, request_id=rid):
        n += len(out.new_token_ids)
    return n


async def run(a) -> dict:
    w = get_workload(a.workload)
    if a.num_requests:
        w.prompts, w.params = w.prompts[:a.num_requests], w.params[:a.num_requests]
    t0 = time.perf_counter()
    llm = AsyncLLM(w.model, core=a.core, load_format="dummy", **w.engine)
    start_s = time.perf_counter() - t0
    try:
        # warm-up as `slipstream bench` does: every prompt, 2 tokens, then forget the prefixes
        warm = [SamplingParams(max_tokens=2, temperature=p.temperature, ignore_eos=True) for p in w.params]
        await asyncio.gather(*[consume(llm, pr, sp, f"warm-{i}") for i, (pr, sp) in enumerate(zip(w.prompts, warm))])
        await llm.reset_prefix_cache()
        pid = llm.core_pid
        core0, self0 = (proc_cpu_s(pid) if pid else 0.0), self_cpu_s()
        t = time.perf_counter()
        counts = await asyncio.gather(*[consume(llm, pr, sp, str(i)) for i, (pr, sp) in enumerate(zip(w.prompts, w.params))])
        wall = time.perf_counter() - t
        core_cpu, front_cpu = (proc_cpu_s(pid) - core0 if pid else None), self_cpu_s() - self0
    finally:
        await llm.shutdown()
    tokens = sum(counts)
    return dict(workload=w.name, core=a.core, requests=len(counts), output_tokens=tokens, wall_s=wall,
                tokens_per_s=tokens / wall, engine_start_s=start_s, front_end_cpu_s=front_cpu,
                core_cpu_s=core_cpu, date=time.strftime("%Y-%m-%d"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="small-256")
    p.add_argument("--core", default="process", choices=["process", "thread"])
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    r = asyncio.run(run(a))
    core = f"{r['core_cpu_s']:.2f} s" if r["core_cpu_s"] is not None else "-"
    print(f"| AsyncLLM ({r['core']} core) | {r['workload']} | {r['wall_s']:.2f} s | {r['tokens_per_s']:,.0f} tok/s | "
          f"front end CPU {r['front_end_cpu_s']:.2f} s | core CPU {core} | start {r['engine_start_s']:.1f} s |")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"async-llm-{r['workload']}-{r['core']}.json"), "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
