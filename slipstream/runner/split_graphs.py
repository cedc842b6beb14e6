"""CUDA graphs of constrained steps (structured outputs): the forward and the sampling apart.

A batch with constrained rows cannot sample until the CPU has filled its token bitmask, which
needs the previous batch's tokens; so its step is two graphs, both in the step graphs' pool:

* the forward graph, per (slot, padded shape, decode split count): carry-over, forward, and
  the sampled rows' final hidden states into the slot's `sample_hidden`; replayed at launch.
* the sampling graph, per (slot, padded sample count, sampler variant): the logits of
  `sample_hidden` and the sampler reading the slot's device bitmask; replayed in
  `ModelRunner.finish_launch` on the compute stream, after the bitmask's copy (h2d stream).

The hidden states, not the logits, wait for the mask: [rows, hidden] is one hundredth of
[rows, vocab] (no [256, 151936] buffer per slot, no copy of it a step); the LM head moves
behind the mask's wait, which the CPU normally fills before the forward ends.

When each is captured (keeping the engine's start as it is):
* a forward graph at its shape's first constrained use, when the startup graphs already ran
  that shape's kernels (`StepGraphs.kernels_warm`), else at its second use;
* a sampling graph at its second use: the first runs eagerly and compiles the sampler's
  bitmask variant.
The second slot's graph of a key is cloned from the first slot's (runner/graph_clone.py) as
the step graphs are.  Penalties and logprobs sample eagerly, as in unconstrained steps.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from slipstream.runner.graph_clone import ClonedGraph
from slipstream.runner.graphs import StepGraphs
from slipstream.runner.inputs import StepShape


class SplitGraphs:
    def __init__(self, steps: StepGraphs) -> None:
        self.steps = steps  # their pool, cloner and warm-up record
        self.graphs: dict[tuple, torch.cuda.CUDAGraph | ClonedGraph] = {}
        self.seen: set[tuple] = set()  # keys that ran eagerly once
        self.replays = {"forward": [0, 0], "sample": [0, 0]}  # per slot

    @staticmethod
    def forward_key(slot_index: int, shape: StepShape) -> tuple:
        return ("forward", slot_index, shape.is_decode, shape.num_tokens, shape.num_seqs, shape.decode_splits)

    @staticmethod
    def sample_key(slot_index: int, shape: StepShape) -> tuple:
        return ("sample", slot_index, shape.num_samples, shape.flags.use_top_k_top_p)

    def forward(self, runner, slot, shape: StepShape) -> bool:
        """Replay (capturing it first where due) the forward graph of a constrained step whose
        inputs are in `slot`; False: the caller runs it eagerly.  On the compute stream."""
        if self.steps.pool is None or not shape.padded:
            return False
        key = self.forward_key(slot.index, shape)
        if key not in self.graphs:
            if not self.steps.kernels_warm(shape) and key not in self.seen:
                self.seen.add(key)
                return False
            self._capture(runner, key, lambda: runner.forward_to_hidden(slot, shape))
        self.graphs[key].replay()
        self.replays["forward"][slot.index] += 1
        return True

    def sample(self, runner, slot, shape: StepShape) -> bool:
        """Replay (capturing it at its second use) the sampling graph of a constrained step whose
        hidden states and bitmask are in `slot`; False: the caller samples eagerly."""
        flags = shape.flags
        if self.steps.pool is None or not shape.padded or flags.use_penalties or flags.num_logprobs:
            return False
        key = self.sample_key(slot.index, shape)
        if key not in self.graphs:
            if key not in self.seen:
                self.seen.add(key)
                return False
            self._capture(runner, key, lambda: runner.sample_deferred(slot, shape))
        self.graphs[key].replay()
        self.replays["sample"][slot.index] += 1
        return True

    def _capture(self, runner, key: tuple, work: Callable[[], None]) -> None:
        """The graph of `key`: cloned from the other slot's where that one was kept, else
        captured (kept for cloning when there is a cloner)."""
        start = time.perf_counter()
        steps = self.steps
        other = self.graphs.get((key[0], 1 - key[1]) + key[2:])
        graph = steps.clone_for_other_slot(other) if other is not None else None
        if graph is None:
            graph = steps.capture_work(runner, work, keep=steps.cloner is not None)
        self.graphs[key] = graph
        steps.capture_s += time.perf_counter() - start
