"""What one CUDA graph shared by the two IO slots would cost a step, measured on the engine's
own captured graph (a design that would halve the graphs captured at start).

Today each slot has its own graphs, so a step's graph reads the inputs its slot was
uploaded into and writes the tokens its slot downloads. A shared graph would read one set
of device buffers: each step would first copy its slot's inputs (what `IOSlot.upload`
copies) into them and afterwards copy the sampled tokens back into its slot. This times
the engine's batch-size graph alternating between the two slots as the engine replays it,
against one slot's graph with those two copies around it, back to back on the compute
stream (the inputs are an all-padding batch: the copies cost the same whatever they hold).

    python benchmarks/bench_slot_copy.py [--workload small-bs1] [--rows 1,64] [--steps 400]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def shared_graph_copies(graph_slot, step_slot, num_seqs: int, num_samples: int):
    """(copy in, copy out) of a step on `step_slot` replaying `graph_slot`'s graph: lists of
    (destination, source) device views; in: the inputs `upload(num_seqs)` writes, out: the
    sampled tokens."""
    end = step_slot.block_table_offset + num_seqs * step_slot.max_blocks
    copy_in = [(graph_slot.dev_int[:end], step_slot.dev_int[:end]),
               (graph_slot.dev_float, step_slot.dev_float)]
    copy_out = [(step_slot.dev.tokens[:num_samples], graph_slot.dev.tokens[:num_samples])]
    return copy_in, copy_out


def time_arms(runner, graphs, rows: int, steps: int):
    """(arm, µs a step) for today's graph per slot and for one graph with the copies."""
    from slipstream.runner.graphs import StepGraphs
    from slipstream.runner.inputs import StepPad, StepShape

    shape = StepShape.padded_to(StepPad(rows, rows), True, StepGraphs.STARTUP_VARIANTS[0],
                                graphs.max_seq_len, graphs.split_options(rows)[0])
    for slot in runner.slots:
        runner.fill_padding(slot, shape)
    copies = [shared_graph_copies(runner.slots[0], runner.slots[i], rows, rows) for i in (0, 1)]

    def own_graphs(i: int) -> None:
        graphs.replay(i % 2, shape)

    def shared_graph(i: int) -> None:
        copy_in, copy_out = copies[i % 2]
        for dst, src in copy_in:
            dst.copy_(src, non_blocking=True)
        graphs.replay(0, shape)
        for dst, src in copy_out:
            dst.copy_(src, non_blocking=True)

    def timed(step) -> float:
        with torch.cuda.stream(runner.streams.compute):
            for i in range(20):
                step(i)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(steps):
                step(i)
            end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / steps

    return [("own graph per slot (today)", timed(own_graphs)), ("one graph, copies around it", timed(shared_graph))]


def main() -> None:
    from slipstream.bench.workloads import get_workload
    from slipstream.config import EngineConfig
    from slipstream.core.engine_core import EngineCore

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="small-bs1")
    ap.add_argument("--rows", default="1", help="decode batch sizes (captured sizes), comma-separated")
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    w = get_workload(args.workload)
    engine = EngineCore(EngineConfig(model=w.model, load_format="dummy", **w.engine))
    runner, graphs = engine.runner, engine.runner.graphs
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, workload {args.workload}, "
          f"{args.steps} steps each, the two arms alternately twice")
    print("| rows | arm | µs a step |\n|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        for rep in (1, 2):
            for name, us in time_arms(runner, graphs, rows, args.steps):
                print(f"| {rows} | {name} ({rep}) | {us:.1f} |", flush=True)
    engine.close()


if __name__ == "__main__":
    main()
