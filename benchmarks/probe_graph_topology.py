"""The structure of a decode step's CUDA graph per slot against the one both slots share.

probe_step_gaps.py found a shared decode graph's kernel boundaries slower inside the graph
in the engine (a few tenths of a µs before every GEMM, and little of PDL's early start
left) while its launch came in time.  This captures one decode shape both ways on a workload's engine
(dummy weights), prints each graph's nodes by type, its edges by kind (plain or
programmatic) and the degrees, and the replay time back to back; the DOT files
(cuGraphDebugDotPrint, verbose) go to `--out`.

    python benchmarks/probe_graph_topology.py [--workload seed-8b-bs8] [--rows 8] [--out DIR]
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import gzip
import os
import re
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def dot_summary(text: str) -> dict:
    """Node types, edge kinds and degrees of a cuGraphDebugDotPrint file."""
    edges = re.findall(r'"?(\w+)"?\s*->\s*"?(\w+)"?([^\n]*)', text)
    nodes = {}
    for name, body in re.findall(r'^\s*"?(\w+)"?\s*\[(.*?)\];?\s*$', text, flags=re.M | re.S):
        kind = re.search(r"\b(KERNEL|MEMCPY|MEMSET|HOST|GRAPH|EMPTY|WAIT_EVENT|EVENT_RECORD|MEM_ALLOC|MEM_FREE|CONDITIONAL)\b", body)
        nodes[name] = kind.group(1) if kind else "other"
    out_deg, in_deg = collections.Counter(a for a, _, _ in edges), collections.Counter(b for _, b, _ in edges)
    kinds = collections.Counter("programmatic" if "rogrammatic" in rest or "dashed" in rest else "plain"
                                for _, _, rest in edges)
    return {"nodes": dict(collections.Counter(nodes.values())), "edges": dict(kinds),
            "max out": max(out_deg.values(), default=0), "max in": max(in_deg.values(), default=0)}


def capture(runner, slot, shape, shared: bool, keep_graph: bool = False,
            instantiate: bool = True) -> torch.cuda.CUDAGraph:
    """A graph of the step on `slot` in the engine's pool, as StepGraphs captures one (a kept
    graph instantiated, unless `instantiate` is False: the caller times that itself)."""
    graph = torch.cuda.CUDAGraph(keep_graph=keep_graph)
    with torch.cuda.graph(graph, pool=runner.graphs.pool, stream=runner.streams.compute):
        runner.compute_step(slot, shape, shared=shared)
    if keep_graph and instantiate:
        graph.instantiate()
    return graph


def main() -> None:
    from slipstream.bench.workloads import get_workload
    from slipstream.config import EngineConfig
    from slipstream.core.engine_core import EngineCore
    from bench_slot_copy import decode_shape, stream_us

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="seed-8b-bs8")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reverse", action="store_true", help="capture the arms in the reverse order")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    w = get_workload(args.workload)
    engine = EngineCore(EngineConfig(model=w.model, load_format="dummy",
                                     **{**w.engine, "cuda_graph_shared_from": args.rows}))
    runner = engine.runner
    shape = decode_shape(runner, args.rows)
    stream = runner.streams.compute
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuGraphDebugDotPrint.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, workload {args.workload}, "
          f"{args.rows}-row decode graph, replays back to back x{args.reps}, "
          f"captured in {'reverse ' if args.reverse else ''}order")
    tmp = tempfile.mkdtemp()
    # the two graphs, and each step on the other's buffers: whether the buffers or the
    # shared step's own kernels (carry-over from either slot, tokens to the step's slot) cost
    arms = [("per slot", runner.slots[0], False), ("shared", runner.graph_slot, True),
            ("per-slot step on the graph slot", runner.graph_slot, False),
            ("shared step on slot 0", runner.slots[0], True)]
    if args.reverse:
        arms.reverse()
    graphs = []  # (name, graph, its DOT summary), all kept alive: each capture takes its own memory
    for name, slot, shared in arms:
        runner.fill_padding(slot, shape)
        graph = capture(runner, slot, shape, shared, keep_graph=True)
        path = os.path.join(tmp, re.sub(r"\W+", "-", name) + ".dot")
        rc = lib.cuGraphDebugDotPrint(graph.raw_cuda_graph(), path.encode(), 1)
        graphs.append((name, graph.replay, dot_summary(open(path).read()) if rc == 0 else {"error": rc}))
        if args.out and rc == 0:
            with open(path, "rb") as src, gzip.open(os.path.join(args.out, os.path.basename(path) + ".gz"), "wb") as dst:
                shutil.copyfileobj(src, dst)
    key = runner.graphs.key(0, shape)  # the engine's own graph of the shape, captured at start
    if key in runner.graphs.graphs:
        graphs.append(("the engine's own", lambda: runner.graphs.replay(0, shape), {}))
    times = {name: [] for name, _, _ in graphs}
    for _ in range(args.rounds):  # in turn, so that a drifting clock shows in every column alike
        for name, replay, _ in graphs:
            times[name].append(stream_us(lambda i: replay(), stream, args.reps, 10))
    print("| graph | nodes | edges | max in / out | " + " | ".join(f"µs a replay, round {i + 1}" for i in range(args.rounds))
          + " |\n|---|---|---|---|" + "---|" * args.rounds)
    for name, _, summary in graphs:
        print(f"| {name} | {summary.get('nodes', '-')} | {summary.get('edges', '-')} | "
              f"{summary.get('max in', '-')} / {summary.get('max out', '-')} | "
              + " | ".join(f"{us:.1f}" for us in times[name]) + " |")
    # the engine's loop, without the host: what runs before each graph on the stream
    runner.fill_padding(runner.slots[1], shape)
    per_slot = {slot.index: capture(runner, slot, shape, shared=False) for slot in runner.slots}
    shared = runner.graphs.graphs[key].replay if key in runner.graphs.graphs else None
    copy = runner.graph_slot.copy_inputs_from

    def copied_shared(src):
        copy(src, shape.num_seqs)
        shared()

    loops = {"per slot, slots in turn (the engine, no sharing)": [per_slot[0].replay, per_slot[1].replay],
             "per slot, slot 0's twice": [per_slot[0].replay, per_slot[0].replay]}
    if shared:
        loops.update({"shared twice, no copy": [shared, shared],
                      "copy from slot 0 + shared, twice": [lambda: copied_shared(runner.slots[0])] * 2,
                      "copy from each slot + shared (the engine, shared)":
                          [lambda: copied_shared(runner.slots[0]), lambda: copied_shared(runner.slots[1])]})
    loop_times = {name: [] for name in loops}
    for _ in range(args.rounds):
        for name, pair in loops.items():
            loop_times[name].append(stream_us(lambda i: pair[i % 2](), stream, args.reps, 20))
    print("\n| two steps in turn | " + " | ".join(f"µs a step, round {i + 1}" for i in range(args.rounds))
          + " |\n|---|" + "---|" * args.rounds)
    for name, us in loop_times.items():
        print(f"| {name} | " + " | ".join(f"{u:.1f}" for u in us) + " |")
    engine.close()


if __name__ == "__main__":
    main()
