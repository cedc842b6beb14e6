"""Where a `slipstream bench` run's GPU time goes, per steady-state step, by kind of kernel.

`profile_step.py` replays the plain decode graph alone; this script runs a bench workload
end to end (speculative steps, FP8, MoE, constrained steps: whatever the flags build) and
profiles `--steps` of its steps once every request is past its prefill:

1. the engine of `slipstream bench` (the same flags, the same construction and warm-up:
   slipstream/bench/run.py), in one mode (`--mode sync|async`; bench's default "both"
   profiles async);
2. the workload's requests, stepped until `--settle` launched batches in a row had no prompt
   chunk, then `--warmup-steps` more;
3. `--steps` steps timed without the profiler (the run's own wall per step), then `--steps`
   under torch.profiler (on a GPU CUDA activity, and the CPU's for the ranges and the launch
   calls; on the CPU its ops).

Each engine step is a profiler range of this script, and so are a few runner entry
points, wrapped on the engine's objects here (the runner's code has no markers): a kernel
counts towards the step, and the innermost range, that launched it (a graph's kernels
towards the call that replays the graph), so in async mode a step's kernels are those of the
batch it launched, whenever they ran.  Reported per step: wall time, kernel time, kernels;
kernel time by kind (profile_step.KINDS) and by range; the top kernels.  The second IO
slot's graphs are captured, not cloned (a clone's launch is invisible to the profiler); with
`--enforce-eager` the ranges split a graphed step's work (forward, LM head, acceptance,
drafter) at eager launch costs.  On the CPU the
"kernels" are the ops' self CPU times (a smoke run of the same path).

Usage: python benchmarks/profile_bench.py --workload seed-8b-bs1 [--steps 40] [--top 25] [--out DIR]
       [any `slipstream bench` flag: --speculative-config JSON --spec-synthetic-accept A
        --quantization fp8 --kv-cache-dtype fp8 --mode sync ...]
"""
from __future__ import annotations

import argparse
import bisect
import collections
import functools
import importlib
import os
import statistics
import sys
import time
from contextlib import ExitStack
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from profile_step import kind_of  # noqa: E402

from slipstream.bench.report import write_json  # noqa: E402
from slipstream.bench.run import bench_engine, warm_up  # noqa: E402
from slipstream.bench.throughput import add_prompt, step_group  # noqa: E402
from slipstream.bench.workloads import get_workload  # noqa: E402
from slipstream.cli.main import build_parser  # noqa: E402
from slipstream.cli.options import BENCH_ENGINE_DEFAULTS, workload_engine_kwargs  # noqa: E402
from slipstream.core.tracing import Timeline  # noqa: E402
from slipstream.utils.process import freeze_gc  # noqa: E402

# The ranges are torch ops (not record_function's user annotations): the kernels launched inside
# one with no op between are linked to it (the fallback of a kernel whose launch call is missing)
_RANGE = getattr(torch._C._profiler, "_RecordFunctionFast", record_function)
STEP = "profile_bench.step "  # + the step's index in the profiled window
RANGE = "profile_bench.range "  # + the range's label
# (where, name, label): the runner's entry points a kernel is attributed to (the innermost
# range around its launch wins).  `where` is an object path on the engine (a method, wrapped on
# the instance) or "module:" and a module whose global function of that name is wrapped where
# its callers look it up; a missing one is skipped.
_SPEC, _DRAFT = "module:slipstream.runner.speculative", "module:slipstream.runner.draft_step"
RANGES = [("runner", "launch", "launch"), ("runner", "replay", "decode graph"),
          ("runner", "compute_step", "eager step"), ("runner", "forward_hidden", "forward"),
          ("runner", "logits", "lm head"), ("runner", "sample", "sample"),
          ("runner", "forward_to_hidden", "constrained forward"),
          ("runner", "finish_launch", "constrained sampling"), ("runner", "wait", "wait"),
          ("runner.split_graphs", "forward", "constrained forward graph"),
          ("runner.split_graphs", "sample", "constrained sampling graph"),
          ("module:slipstream.runner.model_runner", "launch_speculative", "verify"),
          (_SPEC, "_launch_padded", "verify graph"),
          ("module:slipstream.runner.model_runner", "launch_device_drafting", "verify + drafter"),
          (_DRAFT, "launch_drafting_padded", "verify + drafter graph"),
          (_SPEC, "verify", "acceptance"), (_DRAFT, "verify", "acceptance"),
          (_SPEC, "prepare_device_drafts", "device drafts"), (_DRAFT, "prepare_device_drafts", "device drafts"),
          ("runner.drafter", "after_step", "drafter"), ("runner.drafter", "run_catch_up", "drafter catch-up")]


def parse(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(this script's flags, `slipstream bench`'s flags) of `argv`."""
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False,
        epilog="Every other flag is `slipstream bench`'s (python -m slipstream.cli bench --help).")
    ap.add_argument("--steps", type=int, default=40, help="steady-state steps to profile (default 40)")
    ap.add_argument("--warmup-steps", type=int, default=2,
                    help="steps after the prefills end, before timing (default 2)")
    ap.add_argument("--settle", type=int, default=3,
                    help="launched batches in a row without a prompt chunk that end the prefill phase (default 3)")
    ap.add_argument("--top", type=int, default=25, help="kernels listed by total time (default 25)")
    own, rest = ap.parse_known_args(argv)
    if own.steps < 1 or own.settle < 1 or own.warmup_steps < 0 or own.top < 0:
        raise ValueError("--steps and --settle must be >= 1, --warmup-steps and --top >= 0")
    bench = build_parser().parse_args(["bench", *rest])
    return own, bench


def _wrap(owner, name: str, label: str) -> Callable[[], None]:
    """`owner.name` inside a profiler range `label` (on an instance, an instance
    attribute: its class stays as it is); returns the undo."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def ranged(*args, **kwargs):
        with _RANGE(RANGE + label):
            return fn(*args, **kwargs)

    had_own = name in vars(owner)
    setattr(owner, name, ranged)
    return (lambda: setattr(owner, name, fn)) if had_own else (lambda: delattr(owner, name))


def add_ranges(engine) -> tuple[list[str], list[Callable[[], None]]]:
    """Wrap RANGES' functions of `engine`: the labels wrapped and the undos."""
    labels, undos = [], []
    for where, name, label in RANGES:
        if where.startswith("module:"):
            owner = importlib.import_module(where[len("module:"):])
        else:
            owner = engine
            for part in where.split("."):
                owner = getattr(owner, part, None)
        if owner is not None and callable(getattr(owner, name, None)):
            undos.append(_wrap(owner, name, label))
            if label not in labels:
                labels.append(label)
    return labels, undos


def _check(outputs) -> None:
    failed = [o for o in outputs if o.finish_reason == "error"]
    if failed:
        raise ValueError(f"request {failed[0].request_id!r} failed: {failed[0].error}")


def settle(engine, timeline: Timeline, settle_batches: int, warmup_steps: int) -> int:
    """Step until `settle_batches` launched batches in a row had no prompt chunk, then
    `warmup_steps` more; the steps taken (ValueError: the workload ended first)."""
    steps, clean = 0, 0
    while clean < settle_batches:
        if not engine.has_work():
            raise ValueError(f"the workload ended after {steps} steps, before {settle_batches} steps without "
                             "a prompt chunk: give it more requests or tokens")
        before = len(timeline.batches)
        _check(engine.step())
        steps += 1
        for b in timeline.batches[before:]:
            clean = clean + 1 if step_group(b) != "with prefill" else 0
    for _ in range(warmup_steps):
        if engine.has_work():
            _check(engine.step())
            steps += 1
    return steps


def timed_steps(engine, timeline: Timeline, n: int, ranged: bool = False) -> tuple[list[float], list[str]]:
    """Up to `n` steps (fewer if the work ends): each one's wall seconds and the group of the
    batch it launched ("none": it launched none); with `ranged`, each in a STEP range."""
    walls, groups = [], []
    for i in range(n):
        if not engine.has_work():
            break
        before = len(timeline.batches)
        with ExitStack() as stack:
            if ranged:
                stack.enter_context(_RANGE(f"{STEP}{i}"))
            t0 = time.perf_counter()
            outputs = engine.step()
            walls.append(time.perf_counter() - t0)
        _check(outputs)
        launched = timeline.batches[before:]
        groups.append(step_group(launched[0]) if launched else "none")
    return walls, groups


class Intervals:
    """Properly nested (start, end, label) spans of one thread: the innermost one holding a time."""

    def __init__(self, spans: list[tuple[float, float, str]]) -> None:
        self.spans = sorted(spans, key=lambda s: (s[0], -s[1]))
        self.starts = [s[0] for s in self.spans]
        self.parent: list[int | None] = []
        stack: list[int] = []
        for i, (start, _, _) in enumerate(self.spans):
            while stack and self.spans[stack[-1]][1] < start:
                stack.pop()
            self.parent.append(stack[-1] if stack else None)
            stack.append(i)

    def at(self, t: float) -> str | None:
        i = bisect.bisect_right(self.starts, t) - 1
        while i is not None and i >= 0:
            if self.spans[i][1] >= t:
                return self.spans[i][2]
            i = self.parent[i]
        return None


def _is_launch(ev) -> bool:
    """A CUDA runtime or driver call (cudaLaunchKernel, cudaGraphLaunch, cuLaunchKernelEx, ...)."""
    kind = getattr(ev, "activity_type", None)
    return kind in ("cuda_runtime", "cuda_driver") if kind else ev.name.startswith("cu")


def kernel_records(events, on_gpu: bool) -> tuple[list[tuple[int, str, str, float]], dict]:
    """(step, range, kernel name, microseconds) of every kernel a STEP range launched, and the
    microseconds and count of those launched outside them (before the window; "unmatched": no
    launch call found, which should not happen).  A kernel (or memcpy, memset) belongs to the
    ranges around its launch call (matched on the CUPTI correlation id, so a CUDA graph's
    kernels to the graph launch's call); on the CPU each op's self time is a "kernel" of the
    ranges around it."""
    cpu = torch.autograd.DeviceType.CPU
    ours = [ev for ev in events if ev.device_type == cpu and ev.name.startswith((STEP, RANGE))]
    threads = {ev.thread for ev in ours if ev.name.startswith(STEP)}
    steps = Intervals([(ev.time_range.start, ev.time_range.end, ev.name[len(STEP):])
                       for ev in ours if ev.name.startswith(STEP)])
    ranges = Intervals([(ev.time_range.start, ev.time_range.end, ev.name[len(RANGE):])
                        for ev in ours if ev.name.startswith(RANGE)])
    if on_gpu:
        # a kernel's id is its launch call's (CUPTI's correlation); its linked id the torch op's
        # (or range's) around the launch, the fallback
        launch_at = {ev.id: ev.time_range.start for ev in events if ev.device_type == cpu and _is_launch(ev)}
        op_at = {ev.id: ev.time_range.start for ev in events if ev.device_type == cpu and not _is_launch(ev)}
        kernels = []
        for ev in events:
            kind = getattr(ev, "activity_type", None)  # (not a range's GPU span, a sync, an overhead)
            if (ev.device_type != torch.autograd.DeviceType.CUDA or ev.name.startswith((STEP, RANGE))
                    or kind not in (None, "kernel", "gpu_memcpy", "gpu_memset")):
                continue
            t = launch_at.get(ev.id)
            if t is None:
                t = op_at.get(getattr(ev, "linked_correlation_id", 0) or -1)
            kernels.append((t, ev.name, ev.time_range.end - ev.time_range.start))
    else:
        kernels = [(ev.time_range.start, ev.name, ev.self_cpu_time_total) for ev in events
                   if ev.device_type == cpu and ev.thread in threads and not ev.name.startswith((STEP, RANGE))]
    records, outside = [], {"us": 0.0, "kernels": 0, "unmatched": 0}
    for t, name, us in kernels:
        step = steps.at(t) if t is not None else None
        if step is None:
            outside["us"] += us
            outside["kernels"] += 1
            outside["unmatched"] += t is None
        else:
            records.append((int(step), ranges.at(t) or "step", name, us))
    return records, outside


def summarize(records, walls: list[float], groups: list[str], top: int) -> dict:
    """The profiled window's figures per step (module doc)."""
    n = len(walls)
    per_step = [[0.0, 0] for _ in range(n)]
    by_kind, by_range = collections.defaultdict(lambda: [0, 0.0]), collections.defaultdict(lambda: [0, 0.0])
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for step, label, name, us in records:
        per_step[step][0] += us
        per_step[step][1] += 1
        for table, key in ((by_kind, kind_of(name)), (by_range, label), (by_name, name)):
            table[key][0] += 1
            table[key][1] += us

    def rows(table) -> dict:
        return {k: {"per_step": c / n, "us": us / n}
                for k, (c, us) in sorted(table.items(), key=lambda kv: -kv[1][1])}

    wall_us = [1e6 * w for w in walls]
    kernel_us = [s[0] for s in per_step]
    topk = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"steps": n, "step_groups": dict(collections.Counter(groups)),
            "wall_us": sum(wall_us) / n, "wall_us_median": statistics.median(wall_us),
            "kernel_us": sum(kernel_us) / n, "kernel_us_min": min(kernel_us), "kernel_us_max": max(kernel_us),
            "kernels_per_step": sum(s[1] for s in per_step) / n,
            "by_kind": rows(by_kind), "by_range": rows(by_range),
            "top": [{"name": name[:120], "kind": kind_of(name), "per_step": c / n, "us": us / n, "total_us": us}
                    for name, (c, us) in topk],
            "per_step": [{"wall_us": w, "kernel_us": s[0], "kernels": s[1], "group": g}
                         for w, s, g in zip(wall_us, per_step, groups)]}


def report(r: dict) -> str:
    """The short tables of a profile for stdout, the figures per step last (a log's tail keeps
    them): the top kernels, kernel time by range, by kind, then the step's totals."""
    unit = "kernel" if r["on_gpu"] else "CPU op (self time)"
    total = r["kernel_us"] or 1.0
    lines = [f"## profile-bench {r['workload']}: the top {len(r['top'])} by time ({unit}), us a step"]
    for t in r["top"]:
        lines.append(f"  {t['us']:9.1f} us/step  x{t['per_step']:5.1f}  {t['kind']:<10} {t['name'][:90]}")
    for title, table in (("range", r["by_range"]), ("kind", r["by_kind"])):
        lines += [f"| {title} | per step | us/step | share |", "|---|---|---|---|"]
        for key, v in table.items():
            lines.append(f"| {key} | {v['per_step']:.1f} | {v['us']:.1f} | {100 * v['us'] / total:.1f}% |")
    lines += [f"## profile-bench {r['workload']} ({r['mode']}, {r['device']}): {r['steps']} steps "
              f"{r['step_groups']}",
              f"wall {r['wall_us']:.0f} us/step (median {r['wall_us_median']:.0f}; unprofiled "
              f"{r['unprofiled_wall_us']:.0f}), {unit} time {r['kernel_us']:.0f} us/step "
              f"(min {r['kernel_us_min']:.0f}, max {r['kernel_us_max']:.0f}), {r['kernels_per_step']:.1f} a step; "
              f"outside the window {r['outside']['us']:.0f} us ({r['outside']['kernels']} kernels, "
              f"{r['outside']['unmatched']} without a launch call)"]
    return "\n".join(lines)


def profile_bench(own: argparse.Namespace, a: argparse.Namespace) -> dict:
    workload = get_workload(a.workload)
    options = workload_engine_kwargs(a, workload, BENCH_ENGINE_DEFAULTS)
    # both IO slots' graphs captured: a cloned graph launches through the driver API, a call
    # the profiler does not record, so its kernels would have no launch to be matched to
    options["cuda_graph_clone"] = False
    engine, init_s = bench_engine(a, workload, options)
    try:
        on_gpu = engine.device.type == "cuda"
        warm_up(engine, workload)
        freeze_gc()
        mode = "sync" if a.mode == "sync" else "async"
        engine.set_async_scheduling(mode == "async")
        engine.reset_prefix_cache()
        timeline = Timeline()
        engine.loop.timeline = timeline
        for i, (prompt, params) in enumerate(zip(workload.prompts, workload.params)):
            add_prompt(engine, str(i), prompt, params)
        settled = settle(engine, timeline, own.settle, own.warmup_steps)
        plain, _ = timed_steps(engine, timeline, own.steps)
        labels, undos = add_ranges(engine)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        try:
            with profile(activities=activities) as prof:
                walls, groups = timed_steps(engine, timeline, own.steps, ranged=True)
                if on_gpu:
                    torch.cuda.synchronize()  # the window's last launches, done before the profiler stops
        finally:
            for undo in reversed(undos):
                undo()
        if not walls:
            raise ValueError(f"the workload ended before the profiled window ({settled + len(plain)} steps ran)")
        records, outside = kernel_records(prof.events(), on_gpu)
    finally:
        engine.close()
    r = {"workload": workload.name, "mode": mode, "device": torch.cuda.get_device_name() if on_gpu else "cpu",
         "on_gpu": on_gpu, "engine_init_s": init_s, "engine_options": options, "settle_steps": settled,
         "synthetic_acceptance": a.spec_synthetic_accept, "ranges": labels, "outside": outside,
         "unprofiled_wall_us": 1e6 * sum(plain) / len(plain) if plain else float("nan")}
    r.update(summarize(records, walls, groups, own.top))
    return r


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        own, a = parse(argv)
        r = profile_bench(own, a)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(r))
    if a.out:
        write_json(a.out, f"profile_bench_{r['workload']}.json", r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
