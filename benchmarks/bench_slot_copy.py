"""What a CUDA graph shared by the two IO slots costs a step against a graph per slot, on the
engine's own code: two engines of one workload in this process, one with a graph per slot
at the measured sizes (`cuda_graph_shared_from` above them) and one sharing them.

Per slot, a step's graph reads the inputs its slot was uploaded into and writes the
tokens its slot downloads. Shared, `ModelRunner.replay` first copies the step's inputs into
the graph slot, and inside the graph the carry-over reads the other slot's tokens and the
sampled tokens are copied into the step's slot (`ops/carry.py`). Each arm replays a decode
batch of `rows` rows on the two slots in turn, as the engine does, back to back on the
compute stream; the arms alternate twice. The batch is all padding (rows without context:
the attention does nothing), or with `--context N` every row has N positions of random KV
(the engine's runs found shared steps 60-90 µs slower where this padding-only measurement
showed 0-11: docs/benchmarks.md, "Engine start").

    python benchmarks/bench_slot_copy.py [--workload small-bs1] [--rows 1,64] [--steps 400] [--context 1024]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def decode_shape(runner, rows: int):
    """The captured decode shape of `rows` rows (plain sampler, the first split option)."""
    from slipstream.runner.graphs import StepGraphs
    from slipstream.runner.inputs import StepPad, StepShape
    graphs = runner.graphs
    return StepShape.padded_to(StepPad(rows, rows), True, StepGraphs.STARTUP_VARIANTS[0],
                               graphs.max_seq_len, graphs.split_options(rows)[0])


def fill(runner, rows: int, context: int):
    """Both slots' inputs: an all-padding batch, or `rows` rows of `context` positions each
    (bench_step.fill_decode); the shape to replay (its split count picked as the engine does)."""
    from dataclasses import replace
    from bench_step import fill_decode
    shape = decode_shape(runner, rows)
    for slot in runner.slots:
        if context:
            fill_decode(runner, slot, rows, context)
        else:
            runner.fill_padding(slot, shape)
    if context:
        shape = replace(shape, decode_splits=runner.decode_splits(runner.slots[0].host, rows, rows))
    return shape


def stream_us(step, stream, reps: int, warmup: int) -> float:
    """µs a call of `step(i)` on `stream`, `reps` back to back (i = 0, 1, ...) after `warmup`
    unmeasured, by CUDA events."""
    with torch.cuda.stream(stream):
        for i in range(warmup):
            step(i)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(reps):
            step(i)
        end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def time_replays(runner, rows: int, steps: int, context: int = 0) -> float:
    """µs a step of `steps` replays of the `rows`-row decode graph, the slots in turn."""
    shape = fill(runner, rows, context)
    return stream_us(lambda i: runner.replay(runner.slots[i % 2], shape), runner.streams.compute, steps, 20)


def engines(workload: str, rows: list[int], context: int = 0):
    """(per-slot engine, shared engine) of the workload, their KV caches random.  A fixed KV
    pool: sized from free memory, the second engine would count the first's."""
    from slipstream.bench.workloads import get_workload
    from slipstream.config import EngineConfig
    from slipstream.core.engine_core import EngineCore
    w = get_workload(workload)
    per_slot_from = max(w.engine.get("max_num_seqs", 256), max(rows)) + 1
    made = []
    for shared_from in (per_slot_from, min(rows)):
        blocks = max(4096, max(rows) * -(-context // 16))
        cfg = EngineConfig(model=w.model, load_format="dummy", **{**w.engine, "num_kv_blocks": blocks,
                                                                  "cuda_graph_shared_from": shared_from})
        made.append(EngineCore(cfg))
        for k_cache, v_cache in made[-1].runner.kv_caches:  # (zeros can run faster than real data)
            k_cache.normal_()
            v_cache.normal_()
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="small-bs1")
    ap.add_argument("--rows", default="1", help="decode batch sizes (captured sizes), comma-separated")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--context", type=int, default=0, help="positions of every row (0: all padding)")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    per_slot, shared = engines(args.workload, rows, args.context)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, workload {args.workload}, "
          f"{args.steps} steps each, the two arms alternately twice, "
          + (f"rows of {args.context} positions" if args.context else "all-padding rows"))
    print("| rows | arm | µs a step |\n|---|---|---|")
    for n in rows:
        for rep in (1, 2):
            for name, engine in (("a graph per slot", per_slot), ("one shared graph, copies around it", shared)):
                assert engine.runner.graphs.shares(decode_shape(engine.runner, n)) == (engine is shared)
                us = time_replays(engine.runner, n, args.steps, args.context)
                print(f"| {n} | {name} ({rep}) | {us:.1f} |", flush=True)
    for engine in (per_slot, shared):
        engine.close()


if __name__ == "__main__":
    main()
