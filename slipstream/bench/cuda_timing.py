"""Timing of GPU calls for the kernel benchmarks: all calls in one CUDA graph, median of replays.

Capturing the calls together (e.g. the same kernel on rotating inputs) removes launch gaps
and, with inputs larger than L2 in rotation, L2 reuse; the median replay time is divided by
the number of calls.  On a CPU device (interpreter smoke runs) the calls are timed eagerly.
"""
from __future__ import annotations

import statistics
import time

import torch


def time_graph(calls, iters: int = 20, device: str = "cuda") -> float:
    """Median milliseconds per call, all `calls` captured in one CUDA graph."""
    for c in calls:  # compile + warm up
        c()
    if device != "cuda":
        t = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t) * 1e3 / len(calls)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    del graph
    return statistics.median(times)
