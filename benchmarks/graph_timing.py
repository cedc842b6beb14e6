"""What the CUDA-graph probes share: the decode shape the engine captured for a row count,
and the µs a call takes on a stream, timed by CUDA events (probe_clone_cost.py,
probe_capture_cost.py)."""
from __future__ import annotations

import torch


def decode_shape(runner, rows: int):
    """The captured decode shape of `rows` rows (plain sampler, the first split option)."""
    from slipstream.runner.graphs import StepGraphs
    from slipstream.runner.inputs import StepPad, StepShape
    graphs = runner.graphs
    return StepShape.padded_to(StepPad(rows, rows), True, StepGraphs.STARTUP_VARIANTS[0],
                               graphs.max_seq_len, graphs.split_options(rows)[0])


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
