"""CUDA graphs of decode steps: one per (slot, padded batch size, sampler variant, decode
split count).

A graph binds buffer addresses, so each IO slot gets its own graphs.  All of them are
captured into one shared memory pool: they never run at the same time (one compute
stream), and everything they keep lives in static buffers allocated outside capture,
so their scratch memory can overlap and VRAM stays flat as slots are added.  The decode
attention's split count is a launch shape, so a batch size whose best split count depends
on how ragged the rows are gets a graph per candidate (`split_options`), and the runner
picks one per step from the rows' lengths.
"""
from __future__ import annotations

from collections.abc import Callable

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

    def __init__(self, sizes: list[int], max_seq_len: int,
                 split_options: Callable[[int], tuple[int, ...]] | None = None) -> None:
        self.sizes = sorted(sizes)
        self.max_seq_len = max_seq_len
        # batch size -> the decode split counts to capture (None: the kernel's heuristic only)
        self.split_options = split_options or (lambda size: (None,))
        self.graphs: dict[tuple[int, int, bool, int | None], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def padded_size(self, num_seqs: int) -> int | None:
        for size in self.sizes:
            if size >= num_seqs:
                return size
        return None

    @staticmethod
    def _key(slot_index: int, shape: StepShape) -> tuple[int, int, bool, int | None]:
        return slot_index, shape.num_seqs, shape.flags.use_top_k_top_p, shape.decode_splits

    def can_replay(self, slot_index: int, shape: StepShape) -> bool:
        return (shape.padded and not shape.flags.use_penalties and not shape.flags.num_logprobs
                and self._key(slot_index, shape) in self.graphs)

    def replay(self, slot_index: int, shape: StepShape) -> None:
        self.graphs[self._key(slot_index, shape)].replay()

    def capture_all(self, runner, slots=None) -> None:
        """Capture every graph, largest batch first so smaller ones reuse its pool memory."""
        for size in reversed(self.sizes):
            for slot in slots or runner.slots:
                for flags in self.VARIANTS:
                    for splits in self.split_options(size):
                        self._capture(runner, slot, size, flags, splits)

    def _capture(self, runner, slot, size: int, flags: SamplerFlags, splits: int | None) -> None:
        shape = StepShape(size, size, size, 1, self.max_seq_len, flags, padded=True, decode_splits=splits)
        runner.fill_padding(slot, size)
        stream = runner.streams.compute
        with torch.cuda.stream(stream):
            runner.compute_step(slot, shape)  # warm-up: compiles kernels, sets up cuBLAS
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            runner.compute_step(slot, shape)
        self.graphs[self._key(slot.index, shape)] = graph
