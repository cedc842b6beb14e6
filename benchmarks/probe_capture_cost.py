"""Where the CPU time of one CUDA-graph capture goes, against the same step run eagerly.

Builds a workload's engine (dummy weights), then runs one decode shape's step eagerly and
captures it into a throw-away graph, each `--reps` times under cProfile (warm: both already
ran once), and prints per step: the wall time, and the own time of the calls that dominate
(cuBLAS through `F.linear` / `addmm_`, Triton's launch path, graph instantiation); then
the capture's `--top` largest own times, whatever they are.

    python benchmarks/probe_capture_cost.py [--workload small-256] [--rows 64] [--reps 10] [--top 15]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

# label -> what identifies it in cProfile's "file:function" keys
WATCH = {"linear": "torch._C._nn.linear", "addmm_": "'addmm_'", "capture_end": "graphs.py:capture_end",
         "triton run": "runtime/jit.py:run", "triton launcher": "__triton_launcher.launch"}


def own_times(prof: cProfile.Profile) -> dict[str, tuple[int, float]]:
    """(calls, own seconds) of the watched functions."""
    out = {k: (0, 0.0) for k in WATCH}
    for (file, _, name), (_, ncalls, tottime, _, _) in pstats.Stats(prof).stats.items():
        where = f"{file}:{name}"
        for key, pattern in WATCH.items():
            if pattern in where:
                calls, secs = out[key]
                out[key] = (calls + ncalls, secs + tottime)
    return out


def main() -> None:
    from slipstream.bench.workloads import get_workload
    from slipstream.config import EngineConfig
    from slipstream.core.engine_core import EngineCore
    from graph_timing import decode_shape

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="small-256")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--top", type=int, default=15, help="then the capture's N largest own times")
    args = ap.parse_args()
    w = get_workload(args.workload)
    engine = EngineCore(EngineConfig(model=w.model, load_format="dummy", **w.engine))
    runner, graphs = engine.runner, engine.runner.graphs
    shape = decode_shape(runner, args.rows)
    slot = runner.slots[0]
    runner.fill_padding(slot, shape)
    stream = runner.streams.compute

    def eager() -> None:
        with torch.cuda.stream(stream):
            runner.compute_step(slot, shape)

    def capture() -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=graphs.pool, stream=stream):
            runner.compute_step(slot, shape)

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, workload {args.workload}, "
          f"{args.rows} rows, {args.reps} reps each (warm)")
    print("| arm | wall ms a step (no profiler) | profiled ms | " + " | ".join(f"{k} (calls, µs each)" for k in WATCH) + " |")
    print("|---|---|---|" + "---|" * len(WATCH))
    tops = {}
    for name, fn in (("eager", eager), ("capture", capture)):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.reps):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / args.reps
        prof = cProfile.Profile()
        start = time.perf_counter()
        prof.enable()
        for _ in range(args.reps):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        profiled = (time.perf_counter() - start) / args.reps
        cells = []
        for calls, secs in own_times(prof).values():
            per = calls / args.reps
            cells.append(f"{per:.0f}, {secs / calls * 1e6:.1f}" if calls else "-")
        print(f"| {name} | {wall * 1e3:.2f} | {profiled * 1e3:.2f} | " + " | ".join(cells) + " |", flush=True)
        tops[name] = prof
    print(f"\nThe capture's {args.top} largest own times (µs a capture, calls a capture):")
    for (file, line, fn), (_, ncalls, tottime, _, _) in sorted(
            pstats.Stats(tops["capture"]).stats.items(), key=lambda kv: -kv[1][2])[:args.top]:
        print(f"  {tottime / args.reps * 1e6:9.1f}  {ncalls / args.reps:7.1f}  {os.path.basename(file)}:{line}:{fn}")
    engine.close()


if __name__ == "__main__":
    main()
