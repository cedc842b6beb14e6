"""What the compute stream does between and around a workload's steps, in the async loop.

Runs a named workload (dummy weights) in the async loop and records `--steps` steps from
step `--skip` on under torch.profiler; from the trace it prints, per stream, the window's
span a step, the time of its kernels and of its copies by kind (host to device, device to
device, ...), and the idle gaps between them: what a step loses that a back-to-back
microbenchmark does not show. `--no-graph-clone` captures the second slot's graphs instead of
cloning them (`cuda_graph_clone`, the engine's default).  Also the host's CUDA API calls,
summed, and for the larger gaps whether the host's launch of the work after them came late;
`--trace-out` keeps the window's trace.

    python benchmarks/probe_step_gaps.py --workload seed-8b-bs8 [--no-graph-clone]
        [--skip 40] [--steps 40]
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CALLS = ("cuda_runtime", "cuda_driver")


def device_streams(events: list[dict]) -> dict:
    """stream -> its device work (kernels, copies, memsets) in the trace's events, in time order."""
    streams = collections.defaultdict(list)
    for ev in events:
        if ev.get("ph") == "X" and ev.get("cat") in DEVICE_WORK:
            streams[ev["args"].get("stream", ev.get("tid"))].append(ev)
    for evs in streams.values():
        evs.sort(key=lambda e: e["ts"])
    return streams


def busiest_stream(events: list[dict]) -> list[dict]:
    """The device work of the stream with the most of it, in time order."""
    return max(device_streams(events).values(), key=len)


def launch_calls(events: list[dict]) -> dict:
    """correlation id -> the host's CUDA runtime or driver call that launched that work."""
    return {ev["args"]["correlation"]: ev for ev in events
            if ev.get("ph") == "X" and ev.get("cat") in HOST_CALLS and "correlation" in ev.get("args", {})}


def stream_summary(trace: dict, steps: int) -> list[tuple]:
    """(stream, span µs, kernels µs, kernel count, {copy kind: (µs, count)}, gaps µs, largest gap
    µs), a step each, for every stream with device work in the trace."""
    rows = []
    for stream, evs in sorted(device_streams(trace.get("traceEvents", [])).items(), key=lambda kv: -len(kv[1])):
        kernels = [e for e in evs if e["cat"] == "kernel"]
        copies = collections.defaultdict(lambda: [0.0, 0])
        for e in evs:
            if e["cat"] != "kernel":
                c = copies[e["name"]]
                c[0] += e["dur"]
                c[1] += 1
        gaps, largest, end = 0.0, 0.0, evs[0]["ts"]
        for e in evs:
            gap = e["ts"] - end
            if gap > 0:
                gaps += gap
                largest = max(largest, gap)
            end = max(end, e["ts"] + e["dur"])
        span = end - evs[0]["ts"]
        rows.append((stream, span / steps, sum(e["dur"] for e in kernels) / steps, len(kernels) / steps,
                     {k: (us / steps, n / steps) for k, (us, n) in copies.items()}, gaps / steps, largest))
    return rows


def gap_causes(trace: dict, min_gap_us: float = 20.0, top: int = 8) -> list[tuple]:
    """For the idle gaps of at least `min_gap_us` on the busiest stream: (the work after the
    gap, its launching call, gaps, their µs, µs by which that call ended after the gap began,
    on average).  A call that ended after the gap began means the host was late with it;
    one that ended before means the device waited on something else (an event)."""
    events = trace.get("traceEvents", [])
    launches = launch_calls(events)
    evs = busiest_stream(events)
    causes = collections.defaultdict(lambda: [0, 0.0, 0.0])
    end = evs[0]["ts"] + evs[0]["dur"]
    for e in evs[1:]:
        gap = e["ts"] - end
        if gap >= min_gap_us:
            call = launches.get(e["args"].get("correlation"))
            late = call["ts"] + call["dur"] - end if call else float("nan")
            c = causes[(e["name"][:50], call["name"] if call else "?")]
            c[0] += 1
            c[1] += gap
            c[2] += late
        end = max(end, e["ts"] + e["dur"])
    rows = [(work, call, n, us, late / n) for (work, call), (n, us, late) in causes.items()]
    return sorted(rows, key=lambda r: -r[3])[:top]


def kernel_summary(trace: dict, steps: int, top: int = 14) -> list[tuple]:
    """(kernel name, µs a step, launches a step, µs a step it adds to the busiest stream's span)
    for the `top` kernels by the span they add: under PDL a kernel starts before the one before
    it ends, so its own duration overstates what it costs the step; what it adds is its end past
    the latest end before it (idle time before it included)."""
    evs = busiest_stream(trace.get("traceEvents", []))
    kinds = collections.defaultdict(lambda: [0.0, 0, 0.0])
    end = evs[0]["ts"]
    for e in evs:
        k = kinds[e["name"][:60]]
        k[0] += e["dur"]
        k[1] += 1
        k[2] += max(0.0, e["ts"] + e["dur"] - end)
        end = max(end, e["ts"] + e["dur"])
    rows = [(name, us / steps, n / steps, adds / steps) for name, (us, n, adds) in kinds.items()]
    return sorted(rows, key=lambda r: -r[3])[:top]


def api_summary(trace: dict, steps: int, top: int = 6) -> list[tuple]:
    """(API call, µs a step, calls a step, longest µs) of the CUDA runtime and driver calls
    the host made in the window, the `top` costliest: a launch that blocks shows here."""
    calls = collections.defaultdict(list)
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") in HOST_CALLS:
            calls[ev["name"]].append(ev["dur"])
    rows = [(name, sum(d) / steps, len(d) / steps, max(d)) for name, d in calls.items()]
    return sorted(rows, key=lambda r: -r[1])[:top]


def main() -> None:
    from slipstream.bench.throughput import add_prompt, run_until_done
    from slipstream.bench.workloads import get_workload
    from slipstream.config import EngineConfig
    from slipstream.core.engine_core import EngineCore

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="seed-8b-bs8")
    ap.add_argument("--graph-clone", action=argparse.BooleanOptionalAction, default=None,
                    help="clone the second slot's graphs (cuda_graph_clone; default: the engine's, on)")
    ap.add_argument("--skip", type=int, default=40, help="steps before the profiled window")
    ap.add_argument("--steps", type=int, default=40, help="steps profiled")
    ap.add_argument("--trace-out", default=None, help="also keep the window's trace here (gzipped JSON)")
    args = ap.parse_args()
    w = get_workload(args.workload)
    options = dict(w.engine)
    if args.graph_clone is not None:
        options["cuda_graph_clone"] = args.graph_clone
    engine = EngineCore(EngineConfig(model=w.model, load_format="dummy", **options))
    for i, (prompt, params) in enumerate(zip(w.prompts, w.params)):
        add_prompt(engine, str(i), prompt, params)
    for _ in range(args.skip):
        engine.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    if args.trace_out:
        with gzip.open(args.trace_out, "wt") as f:
            json.dump({"traceEvents": [e for e in trace["traceEvents"] if e.get("ph") == "X"]}, f)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, workload {args.workload}, "
          f"graph clones {engine.config.cuda_graph_clone}, "
          f"steps {args.skip}..{args.skip + args.steps}; µs a step")
    print("| stream | span | kernels | kernel count | copies (µs, count) | gaps | largest gap |\n|---|---|---|---|---|---|---|")
    for stream, span, kern, count, copies, gaps, largest in stream_summary(trace, args.steps):
        cp = "; ".join(f"{k}: {us:.1f}, {n:.1f}" for k, (us, n) in copies.items()) or "-"
        print(f"| {stream} | {span:.1f} | {kern:.1f} | {count:.1f} | {cp} | {gaps:.1f} | {largest:.1f} |")
    print("| kernel (busiest stream) | µs a step | launches a step | µs it adds to the span |\n|---|---|---|---|")
    for name, us, n, adds in kernel_summary(trace, args.steps):
        print(f"| {name} | {us:.1f} | {n:.1f} | {adds:.1f} |")
    print("| host API call | µs a step | calls a step | longest µs |\n|---|---|---|---|")
    for name, us, n, longest in api_summary(trace, args.steps):
        print(f"| {name} | {us:.1f} | {n:.1f} | {longest:.1f} |")
    print("| after gaps ≥20 µs on the busiest stream: work | its launch call | gaps | µs | call end − gap start, µs |"
          "\n|---|---|---|---|---|")
    for work, call, n, us, late in gap_causes(trace):
        print(f"| {work} | {call} | {n} | {us:.0f} | {late:.0f} |")
    run_until_done(engine)
    engine.close()


if __name__ == "__main__":
    main()
