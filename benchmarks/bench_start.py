"""Engine start, process start to ready, as a user meets it: a fresh Python process builds
the engine of a workload (dummy weights, every CUDA graph it replays) and says ready.

Each tree given (e.g. a baseline from `git archive <commit> | tar -x -C .baseline`, then
`.`) runs in its own process, alternately, `--reps` times; Triton's cache is warmed by a
first, untimed start of each tree.  Prints a table of seconds per tree and run.  A tree
may carry engine options after commas, `DIR,key=value,...` (EngineConfig fields; values
read as Python literals, e.g. `.,cuda_graph_clone=False`), so that two settings of one
tree are compared in one run.

The breakdown adds the garbage collector's runs while the engine is built (`gc`:
generation -> [seconds, runs]).

`--profile` instead starts one process that times its phases (Python + torch import, CUDA
context, slipstream imports) and runs the engine's construction under cProfile, printing
the functions with the most own and cumulative time: where the seconds of a start go.

Usage: python benchmarks/bench_start.py [--workload small-256] [--tree DIR[,key=value] ...] [--reps 2] [--profile]
"""
from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import time

CHILD = """
import json
from slipstream.bench.throughput import GcPauses
from slipstream.bench.workloads import get_workload
from slipstream.config import EngineConfig
from slipstream.core.engine_core import EngineCore
w = get_workload({workload!r})
with GcPauses() as pauses:
    engine = EngineCore(EngineConfig(model=w.model, load_format="dummy", **{{**w.engine, **{overrides!r}}}))
gc = {{g: [round(p["total_ms"] / 1e3, 3), p["count"]] for g, p in pauses.summary().items()}}
print("READY", json.dumps(dict(getattr(engine, "startup", None) or {{}}, gc=gc)), flush=True)
"""

PROFILE_CHILD = """
import time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
torch.cuda.init(); torch.empty(1, device="cuda"); torch.cuda.synchronize()
t2 = time.perf_counter()
from slipstream.bench.workloads import get_workload
from slipstream.config import EngineConfig
from slipstream.core.engine_core import EngineCore
t3 = time.perf_counter()
print(f"phase: import torch {{t1 - t0:.2f}} s, CUDA context {{t2 - t1:.2f}} s, slipstream imports {{t3 - t2:.2f}} s")
import cProfile, io, pstats
w = get_workload({workload!r})
prof = cProfile.Profile()
prof.enable()
engine = EngineCore(EngineConfig(model=w.model, load_format="dummy", **w.engine))
prof.disable()
print(f"phase: engine {{time.perf_counter() - t3:.2f}} s; startup breakdown {{engine.startup}}")
for key in ("tottime", "cumulative"):
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(30)
    print(buf.getvalue())
"""


def _tree_env(tree: str) -> dict:
    """The environment of a child that imports slipstream from `tree`."""
    return dict(os.environ, PYTHONPATH=os.path.abspath(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def profile_once(tree: str, workload: str) -> None:
    env = _tree_env(tree)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", PROFILE_CHILD.format(workload=workload)], cwd=tree, env=env, check=True)
    print(f"process start to exit (profiled): {time.perf_counter() - t0:.2f} s")


def parse_tree(arg: str) -> tuple[str, dict]:
    """`DIR[,key=value,...]` -> (DIR, engine options)."""
    tree, *options = arg.split(",")
    overrides = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep:
            raise SystemExit(f"--tree {arg!r}: {option!r} is not key=value")
        overrides[key] = ast.literal_eval(value)
    return tree, overrides


def start_once(arg: str, workload: str) -> tuple[float, str]:
    tree, overrides = parse_tree(arg)
    env = _tree_env(tree)
    t0 = time.perf_counter()
    child = CHILD.format(workload=workload, overrides=overrides)
    proc = subprocess.Popen([sys.executable, "-c", child], cwd=tree, env=env,
                            stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("READY"):
            ready = time.perf_counter() - t0
            proc.kill()
            proc.wait()
            return ready, line[6:].strip()
    raise RuntimeError(f"{tree}: the engine did not start (exit {proc.wait()})")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="small-256")
    ap.add_argument("--tree", action="append", default=[])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="one profiled start per tree (see above)")
    args = ap.parse_args()
    trees = args.tree or ["."]
    if args.profile:
        for tree in trees:
            profile_once(parse_tree(tree)[0], args.workload)
        return 0
    for tree in trees:  # warm Triton's cache (and the page cache) for every tree
        start_once(tree, args.workload)
    print("| tree | run | process start to ready | startup breakdown |\n|---|---|---|---|")
    for rep in range(1, args.reps + 1):
        for tree in trees:
            seconds, breakdown = start_once(tree, args.workload)
            print(f"| {tree} | {rep} | {seconds:.2f} s | {breakdown} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
