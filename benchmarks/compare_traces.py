"""Two step-window traces of probe_step_gaps.py (`--trace-out`) side by side, kernel by kernel.

For each kernel name on the busiest stream: launches, time and the idle time before it
(negative: it started before the previous one ended, as PDL allows), a step, in each trace,
the names whose time plus gap differ most first; then, for each graph launch of 100 kernels
or more, how long the host's cudaGraphLaunch took and how far ahead of the graph's first
kernel it ended (negative: ahead), so a late launch and a slower graph tell apart.

    python benchmarks/compare_traces.py A.json.gz B.json.gz [--steps 40] [--top 20]
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics

from probe_step_gaps import busiest_stream, launch_calls


def load(path: str) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def per_kernel(events: list[dict]) -> dict[str, list[float]]:
    """name -> [launches, µs, µs idle before], summed over the busiest stream."""
    stats = collections.defaultdict(lambda: [0, 0.0, 0.0])
    end = None
    for e in busiest_stream(events):
        s = stats[e["name"][:70]]
        s[0] += 1
        s[1] += e["dur"]
        if end is not None:
            s[2] += e["ts"] - end
        end = e["ts"] + e["dur"]
    return stats


def graph_launches(events: list[dict]) -> list[tuple[float, float]]:
    """(cudaGraphLaunch µs, its end minus the graph's first kernel start µs) per graph launch."""
    calls = launch_calls(events)
    kernels = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "kernel":
            kernels[e["args"].get("correlation")].append(e["ts"])
    out = []
    for corr, starts in kernels.items():
        call = calls.get(corr)
        if call and call["name"] == "cudaGraphLaunch" and len(starts) >= 100:
            out.append((call["dur"], call["ts"] + call["dur"] - min(starts)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--steps", type=int, default=40, help="steps in each window")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    ta, tb = load(args.a), load(args.b)
    a, b = per_kernel(ta), per_kernel(tb)
    zero = [0, 0.0, 0.0]
    rows = sorted(set(a) | set(b), key=lambda k: -abs(sum(b.get(k, zero)[1:]) - sum(a.get(k, zero)[1:])))
    n = args.steps
    print("a step: | kernel | launches A / B | µs A / B | idle before A / B |\n|---|---|---|---|")
    for k in rows[:args.top]:
        x, y = a.get(k, zero), b.get(k, zero)
        print(f"| {k} | {x[0] / n:.1f} / {y[0] / n:.1f} | {x[1] / n:.1f} / {y[1] / n:.1f} | {x[2] / n:.1f} / {y[2] / n:.1f} |")
    print("\n| trace | graph launches | cudaGraphLaunch µs, median | launch end − first kernel µs, median (max) |\n|---|---|---|---|")
    for name, t in (("A", ta), ("B", tb)):
        g = graph_launches(t)
        if g:
            print(f"| {name} | {len(g)} | {statistics.median(d for d, _ in g):.0f} | "
                  f"{statistics.median(e for _, e in g):.0f} ({max(e for _, e in g):.0f}) |")


if __name__ == "__main__":
    main()
