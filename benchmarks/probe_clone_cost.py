"""What the second IO slot's CUDA graph of a step costs to make, cloned from the first
slot's (runner/graph_clone.py) against captured, and what each costs to replay.

Builds a workload's engine (dummy weights; cloning on, so the first slot's graphs are kept
for cloning), then for `--shapes` of its startup shapes, evenly spread from the largest
mixed step to one-row decode, makes slot 1's graph three ways and prints per shape:
- capture: as StepGraphs captures (`torch.cuda.graph`, with its synchronize and cache
  emptying), ms;
- capture kept + instantiate: the same capture with keep_graph=True, then `instantiate()`;
- clone: `clone_graph` from slot 0's graph, in its phases (cuGraphClone, re-pointing the
  nodes, instantiate);
- the graph's dependency edges by type (full, programmatic, programmatic-event: PDL), in the
  capture and in a cuGraphClone of slot 0's graph;
- replay µs (CUDA events, `--reps` back to back) of slot 0's graph, the clone (instantiated
  as torch instantiates, and with no flags) and the capture; and of slot 0's graph and the
  clone in turn, against slot 0's and the capture in turn (as the engine replays them).
Then, per shape, how the kernel arguments of slot 0's graph and slot 1's capture differ
(equal, the slots' buffers, other: does a capture get its own scratch memory, which a clone
shares?), and the driver API calls the clones made: calls and µs each.

    python benchmarks/probe_clone_cost.py [--workload small-256] [--shapes 8] [--reps 200] [--budget-s 2]
        [--profile 1] [--rows 8 ...]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def edge_types(driver, graph) -> dict[int, int]:
    """How many dependency edges of `graph` are of each CUgraphDependencyType (0 full,
    1 programmatic, 2 programmatic event)."""
    count = ctypes.c_size_t()
    driver.call("cuGraphGetEdges_v2", graph, None, None, None, ctypes.byref(count))
    n = count.value
    src, dst, data = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (ctypes.c_ubyte * (8 * n))()
    driver.call("cuGraphGetEdges_v2", graph, src, dst, data, ctypes.byref(count))
    types: dict[int, int] = {}
    for i in range(n):
        types[data[8 * i + 2]] = types.get(data[8 * i + 2], 0) + 1  # CUgraphEdgeData.type
    return types


def copied_edge_types(driver, graph_handle: int) -> dict[int, int]:
    clone = ctypes.c_void_p()
    driver.call("cuGraphClone", ctypes.byref(clone), ctypes.c_void_p(graph_handle))
    try:
        return edge_types(driver, clone)
    finally:
        driver.lib.cuGraphDestroy(clone)


def argument_differences(driver, graph_a: int, graph_b: int, amap) -> dict[str, int]:
    """Kernel argument words (those that may hold an address) of two graphs of one step,
    node by node in creation order: equal, different where `amap` maps a's word to b's (the
    slots' buffers), and different otherwise (another scratch address, or a value)."""
    from slipstream.runner.graph_nodes import NODE_KERNEL, graph_nodes, kernel_node_words
    counts = {"nodes": 0, "equal": 0, "slot-mapped": 0, "other": 0}
    nodes = [graph_nodes(driver, ctypes.c_void_p(g)) for g in (graph_a, graph_b)]
    if len(nodes[0]) != len(nodes[1]):
        return {"node counts differ": 1}
    for na, nb in zip(*nodes):
        kind = ctypes.c_int()
        driver.call("cuGraphNodeGetType", na, ctypes.byref(kind))
        if kind.value != NODE_KERNEL:
            continue
        a, b = (kernel_node_words(driver, n) for n in (na, nb))
        counts["nodes"] += 1
        if len(a) != len(b):
            counts["other"] += max(len(a), len(b))
            continue
        equal = a == b
        mapped = ~equal & (amap.moved(a) == b)
        counts["equal"] += int(equal.sum())
        counts["slot-mapped"] += int(mapped.sum())
        counts["other"] += int((~equal & ~mapped).sum())
    return counts


def capture_slot1(runner, shape, keep: bool):
    """Slot 1's graph of `shape` captured as StepGraphs captures it: (graph, ms; with `keep`,
    also the ms of instantiating it)."""
    start = time.perf_counter()
    graph = torch.cuda.CUDAGraph(keep_graph=keep)
    with torch.cuda.graph(graph, pool=runner.graphs.pool, stream=runner.streams.compute):
        runner.compute_step(runner.slots[1], shape)
    middle = time.perf_counter()
    if keep:
        graph.instantiate()
    return graph, (middle - start) * 1e3, (time.perf_counter() - middle) * 1e3


def measure_shape(runner, driver, shape, args) -> tuple[str, dict[str, int]]:
    """One row of the table for `shape`, and how slot 0's graph and slot 1's capture differ."""
    from graph_timing import stream_us

    from slipstream.runner.graph_clone import clone_graph
    from slipstream.runner.graph_nodes import graph_nodes
    graphs, compute = runner.graphs, runner.streams.compute
    source = graphs.graphs[graphs.key(0, shape)]
    for slot in runner.slots:
        runner.fill_padding(slot, shape)
    captured, plain_ms, _ = capture_slot1(runner, shape, keep=False)
    kept, kept_ms, instantiate_ms = capture_slot1(runner, shape, keep=True)
    nodes = len(graph_nodes(driver, ctypes.c_void_p(kept.raw_cuda_graph())))
    phases: dict[str, float] = {}
    start = time.perf_counter()
    cloned = clone_graph(driver, source.raw_cuda_graph(), graphs.cloner.map, phases)
    clone_ms = (time.perf_counter() - start) * 1e3
    unflagged = clone_graph(driver, source.raw_cuda_graph(), graphs.cloner.map, flags=0)
    counts = argument_differences(driver, source.raw_cuda_graph(), kept.raw_cuda_graph(), graphs.cloner.map)
    edges = (edge_types(driver, ctypes.c_void_p(kept.raw_cuda_graph())),
             copied_edge_types(driver, source.raw_cuda_graph()))
    torch.cuda.synchronize()
    once = stream_us(lambda i: source.replay(), compute, 1, 1)  # (big mixed steps: fewer reps)
    reps = max(5, min(args.reps, int(args.budget_s * 1e6 / 4 / once)))
    replay = [stream_us(lambda i, g=g: g.replay(), compute, reps, min(20, reps))
              for g in (source, cloned, unflagged, captured)]
    pairs = [stream_us(lambda i, g=g: (source if i % 2 == 0 else g).replay(), compute, 2 * reps, min(20, reps))
             for g in (cloned, captured)]  # as the engine runs them: the two slots' graphs in turn
    row = (f"| {shape.num_tokens}, {shape.num_seqs}{' decode' if shape.is_decode else ''} | {nodes} | "
           f"{plain_ms:.1f} | {kept_ms:.1f} + {instantiate_ms:.1f} | {clone_ms:.1f} ("
           + ", ".join(f"{phases[k] * 1e3:.1f}" for k in ("clone", "repoint", "instantiate"))
           + f") | {cloned.nodes_repointed} | "
           + " / ".join(" ".join(f"{t}:{n}" for t, n in sorted(e.items())) for e in edges) + " | "
           + ", ".join(f"{us:.1f}" for us in replay) + " | " + ", ".join(f"{us:.1f}" for us in pairs) + " |")
    return row, counts


def profile_clones(driver, graphs, shapes) -> None:
    """Where a clone's time goes in Python: cProfile of cloning each of `shapes`."""
    import cProfile
    import pstats
    from slipstream.runner.graph_clone import clone_graph
    for shape in shapes:
        source = graphs.graphs[graphs.key(0, shape)]
        prof = cProfile.Profile()
        prof.enable()
        cloned = clone_graph(driver, source.raw_cuda_graph(), graphs.cloner.map)
        prof.disable()
        print(f"\ncProfile of cloning shape ({shape.num_tokens}, {shape.num_seqs}):")
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(14)
        del cloned


def main() -> None:
    from slipstream.bench.workloads import get_workload
    from slipstream.config import EngineConfig
    from slipstream.core.engine_core import EngineCore
    from slipstream.runner.graph_nodes import Driver

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="small-256")
    ap.add_argument("--shapes", type=int, default=8)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rows", type=int, nargs="*", default=[], help="also the decode shapes of these rows")
    ap.add_argument("--budget-s", type=float, default=2.0, help="seconds of replays a shape at most")
    ap.add_argument("--profile", type=int, default=1, help="cProfile this many clones (top functions)")
    args = ap.parse_args()
    w = get_workload(args.workload)
    engine = EngineCore(EngineConfig(model=w.model, load_format="dummy", **{**w.engine, "cuda_graph_clone": True}))
    runner, graphs = engine.runner, engine.runner.graphs
    shapes = graphs.startup_shapes()
    shapes = shapes[::max(1, len(shapes) // args.shapes)][:args.shapes] + [
        s for s in shapes if s.is_decode and s.num_seqs in args.rows]
    driver = Driver(timed=True)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, workload {args.workload}, "
          f"startup {engine.startup}")
    print("| shape (tokens, rows) | nodes | capture ms | capture kept + instantiate ms | clone ms "
          "(clone, repoint, instantiate) | nodes re-pointed | edges by type, capture / clone "
          "| replay µs slot 0, clone, clone (flags 0), capture | in turn with slot 0's: clone, capture |")
    print("|---|---|---|---|---|---|---|---|---|")
    differences = []
    for shape in shapes:
        row, counts = measure_shape(runner, driver, shape, args)
        print(row, flush=True)
        differences.append((shape, counts))
    print("\nslot 0's graph against slot 1's captured (kept), kernel argument words that may be addresses:")
    for shape, counts in differences:
        print(f"  ({shape.num_tokens}, {shape.num_seqs}): {counts}")
    print(f"\nkernels whose argument layout was read: {len(driver.layouts)}")
    profile_clones(driver, graphs, shapes[:args.profile])
    print("\n| driver call | calls | µs each |\n|---|---|---|")
    for name, (secs, calls) in sorted(driver.timings.items(), key=lambda kv: -kv[1][0]):
        print(f"| {name} | {calls} | {secs / calls * 1e6:.1f} |")
    engine.close()


if __name__ == "__main__":
    main()
