"""CUDA graphs of decode steps: one per (slot, padded batch size, sampler variant).

A graph binds buffer addresses, so each IO slot gets its own graphs.  All of them are
captured into one shared memory pool: they never run at the same time (one compute
stream), and everything they keep lives in static buffers allocated outside capture,
so their scratch memory can overlap and VRAM stays flat as slots are added.
"""
from __future__ import annotations

import torch

from slipstream.runner.inputs import StepShape
from slipstream.sampler import SamplerFlags


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch (and max_batch itself)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    VARIANTS = (SamplerFlags(False, False, 0), SamplerFlags(True, False, 0))

    def __init__(self, sizes: list[int], max_seq_len: int) -> None:
        self.sizes = sorted(sizes)
        self.max_seq_len = max_seq_len
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def padded_size(self, num_seqs: int) -> int | None:
        for size in self.sizes:
            if size >= num_seqs:
                return size
        return None

    def can_replay(self, slot_index: int, shape: StepShape) -> bool:
        return (shape.padded and not shape.flags.use_penalties and not shape.flags.num_logprobs
                and (slot_index, shape.num_seqs, shape.flags.use_top_k_top_p) in self.graphs)

    def replay(self, slot_index: int, shape: StepShape) -> None:
        self.graphs[(slot_index, shape.num_seqs, shape.flags.use_top_k_top_p)].replay()

    def capture_all(self, runner, slots=None) -> None:
        """Capture every graph, largest batch first so smaller ones reuse its pool memory."""
        for size in reversed(self.sizes):
            for slot in slots or runner.slots:
                for flags in self.VARIANTS:
                    self._capture(runner, slot, size, flags)

    def _capture(self, runner, slot, size: int, flags: SamplerFlags) -> None:
        shape = StepShape(size, size, size, 1, self.max_seq_len, flags, padded=True)
        runner.fill_padding(slot, size)
        stream = runner.streams.compute
        with torch.cuda.stream(stream):
            runner.compute_step(slot, shape)  # warm-up: compiles kernels, sets up cuBLAS
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            runner.compute_step(slot, shape)
        self.graphs[(slot.index, size, flags.use_top_k_top_p)] = graph
