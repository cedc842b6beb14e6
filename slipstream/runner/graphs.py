"""CUDA graphs of whole steps, decode and mixed.

* Decode steps: one graph per (slot, padded batch size, sampler variant, decode split
  count).  The decode attention's split count is a launch shape, so a batch size whose
  best split count depends on how ragged the rows are gets a graph per candidate
  (`split_options`), and the runner picks one per step from the rows' lengths.
* Steps with prompt tokens (prefill / mixed): one graph per (slot, padded token count,
  sampler variant), every row count padded to `mixed_seqs`.  Eager, such a step is ~350
  launches; on a slow host their CPU time exceeded the 0.6B model's GPU time
  (benchmarks/notes/benchmarks.md).  Padding tokens and rows cost GPU time, so the token sizes are
  ~1.5x apart.

* At start only the plain sampler variant is captured; a (slot, shape) that needs the
  top-k/top-p variant runs eagerly the first time (which also compiles its kernels) and is
  captured the second time, then replayed.  Every startup graph was one of the two
  variants, so this halves the start's graphs (benchmarks/notes/benchmarks.md,
  "Engine start").
* A warm-up run before a capture compiles kernels and lets cuBLAS set up; one run per group
  of shapes whose kernels specialise alike (`_warmup_group`) is enough.

A graph binds buffer addresses, so each IO slot gets its own graphs.  With `clone_slots`
(EngineConfig.cuda_graph_clone, on by default) only the first slot's graph of a shape is
captured; the second slot's is a copy of it re-pointed at that slot's buffers
(runner/graph_clone.py): the same kernels, without Python launching them again.

All graphs are captured into one memory pool: they never run at the same time (one compute
stream), and everything they keep lives in static buffers allocated outside capture,
so their scratch memory can overlap and VRAM stays flat as slots are added.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from slipstream.runner.graph_clone import ClonedGraph, SlotGraphCloner
from slipstream.runner.inputs import StepPad, StepShape
from slipstream.sampling.sampler import SamplerFlags


def capture_sizes(max_batch: int) -> list[int]:
    """Decode batch sizes: 1, 2, 4, 8, then every multiple of 8 up to max_batch (and
    max_batch itself)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def mixed_graph_tokens(opts) -> int:
    """The token count of the largest mixed-step graph the runner captures (RunnerOptions),
    0 for none.  Those graphs pad rows to max_num_seqs, so they are captured only when the
    decode graphs reach max_num_seqs rows too."""
    if not opts.use_cuda_graphs or opts.cuda_graph_max_batch < opts.max_num_seqs:
        return 0
    return min(opts.cuda_graph_max_tokens, max(opts.max_num_batched_tokens, opts.max_num_seqs))


def mixed_token_sizes(max_tokens: int, smallest: int = 512) -> list[int]:
    """Token counts of mixed-step graphs: 512, 1024, 1536, 2048, 3072, 4096, 6144, ...
    (powers of two and 1.5x them) below max_tokens, and max_tokens itself."""
    sizes, p = [], smallest
    while p < max_tokens:
        sizes += [s for s in (p, p * 3 // 2) if s < max_tokens and s % smallest == 0]
        p *= 2
    return sorted(set(sizes)) + [max_tokens] if max_tokens > 0 else []


def step_graphs(opts, device: torch.device, split_policy=None) -> "StepGraphs | None":
    """The graphs a runner with options `opts` captures on `device` (None: it runs eagerly),
    not captured yet; their sizes alone decide how a batch is padded."""
    if not opts.use_cuda_graphs or device.type != "cuda":
        return None
    max_batch = min(opts.cuda_graph_max_batch, opts.max_num_seqs)
    return StepGraphs(capture_sizes(max_batch), mixed_token_sizes(mixed_graph_tokens(opts)),
                      opts.max_num_seqs, opts.max_model_len, split_policy.options if split_policy else None,
                      clone_slots=opts.cuda_graph_clone)


class StepGraphs:
    STARTUP_VARIANTS = (SamplerFlags(False, False, 0),)  # captured at start
    LAZY_VARIANTS = (SamplerFlags(True, False, 0),)  # captured at their second use

    def __init__(self, decode_sizes: list[int], mixed_sizes: list[int], mixed_seqs: int,
                 max_seq_len: int, split_options: Callable[[int], tuple[int, ...]] | None = None,
                 clone_slots: bool = False) -> None:
        self.decode_sizes = sorted(decode_sizes)
        self.mixed_sizes = sorted(mixed_sizes)
        self.mixed_seqs = mixed_seqs
        self.max_seq_len = max_seq_len
        # batch size -> the decode split counts to capture (None: the kernel's heuristic only)
        self.split_options = split_options or (lambda size: (None,))
        self.clone_slots = clone_slots  # the second slot's graphs cloned from the first's
        self.cloner: SlotGraphCloner | None = None  # made at the first capture (needs the slots)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph | ClonedGraph] = {}
        self.pool = None  # the shared memory pool, made at the first capture
        self.capture_s = 0.0  # wall time of capture_all (warm-up runs, captures), for startup reports
        self.warmup_s = 0.0  # of which the eager warm-up runs before each capture
        self.warmed: set[tuple] = set()  # warm-up groups already run
        self.seen_lazy: set[tuple] = set()  # lazy (slot, shape) keys that ran eagerly once

    def padding(self, num_tokens: int, num_seqs: int, decode: bool) -> StepPad | None:
        """The captured sizes a batch is padded to, or None (it runs eagerly)."""
        if decode:
            size = _first_at_least(self.decode_sizes, num_seqs)
            return StepPad(size, size) if size is not None else None
        size = _first_at_least(self.mixed_sizes, num_tokens)
        if size is None or num_seqs > self.mixed_seqs:
            return None
        return StepPad(size, self.mixed_seqs)

    def key(self, slot_index: int, shape: StepShape) -> tuple:
        """A graph's key in `graphs`: its slot's index and its shape."""
        return (slot_index, shape.is_decode, shape.num_tokens, shape.num_seqs,
                shape.flags.use_top_k_top_p, shape.decode_splits)

    def can_replay(self, slot_index: int, shape: StepShape) -> bool:
        return (shape.padded and not shape.flags.use_penalties and not shape.flags.num_logprobs
                and self.key(slot_index, shape) in self.graphs)

    def replay(self, slot_index: int, shape: StepShape) -> None:
        """Replay the graph a step of `shape` on that slot takes."""
        self.graphs[self.key(slot_index, shape)].replay()

    def capture_if_seen(self, runner, slot, shape: StepShape) -> bool:
        """A step of a lazily captured variant that has no graph yet: capture it (for this
        slot) if it ran eagerly before, and say whether it can now be replayed; else
        remember it.  Called on the compute stream, inputs already in the slot."""
        if self.pool is None or not shape.padded or shape.flags.use_penalties or shape.flags.num_logprobs:
            return False  # (no pool: nothing was captured, e.g. sizes used for padding alone)
        if not any(shape.flags == f for f in self.LAZY_VARIANTS):
            return False
        key = self.key(slot.index, shape)
        if key not in self.seen_lazy:
            self.seen_lazy.add(key)
            return False
        start = time.perf_counter()
        other = self.graphs.get(self.key(1 - slot.index, shape))
        if not self._clone(runner, other, slot, shape):
            self._capture_one(runner, slot, shape, keep=self.cloner is not None)
        self.capture_s += time.perf_counter() - start
        return True

    def kernels_warm(self, shape: StepShape) -> bool:
        """Whether a step of `shape`'s sizes ran once with the startup sampler variant: its
        forward's kernels are compiled and cuBLAS set up, so it may be captured at once."""
        return _warmup_group(replace(shape, flags=self.STARTUP_VARIANTS[0])) in self.warmed

    def capture_all(self, runner, slots=None) -> None:
        """Capture every graph, the largest first so smaller ones reuse its pool memory; a
        graph per slot of `slots` (default both)."""
        slots = slots or runner.slots
        start = time.perf_counter()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
            if self.clone_slots and len(runner.slots) == 2:
                self.cloner = SlotGraphCloner(runner.slots)
        for shape in self.startup_shapes():
            self._capture(runner, slots, shape)
        self.capture_s += time.perf_counter() - start

    def startup_shapes(self) -> list[StepShape]:
        """The shapes captured at start, the largest first: mixed steps, then decode batches."""
        shapes = [StepShape.padded_to(StepPad(size, self.mixed_seqs), False, flags, self.max_seq_len)
                  for size in reversed(self.mixed_sizes) for flags in self.STARTUP_VARIANTS]
        return shapes + [StepShape.padded_to(StepPad(size, size), True, flags, self.max_seq_len, splits)
                         for size in reversed(self.decode_sizes) for flags in self.STARTUP_VARIANTS
                         for splits in self.split_options(size)]

    def _capture(self, runner, slots, shape: StepShape) -> None:
        """A warm-up run where its group needs one (compiles kernels, sets up cuBLAS), then a
        graph per slot."""
        group = _warmup_group(shape)
        for slot in slots:
            runner.fill_padding(slot, shape)
        if group not in self.warmed:
            start = time.perf_counter()
            with torch.cuda.stream(runner.streams.compute):
                runner.compute_step(slots[0], shape)
            torch.cuda.synchronize(runner.device)
            self.warmup_s += time.perf_counter() - start
            self.warmed.add(group)
        first, *rest = slots
        graph = self._capture_one(runner, first, shape, keep=bool(rest) and self.cloner is not None)
        for slot in rest:
            if not self._clone(runner, graph, slot, shape):
                self._capture_one(runner, slot, shape)

    def _capture_one(self, runner, slot, shape: StepShape, keep: bool = False) -> torch.cuda.CUDAGraph:
        """A graph of the step on `slot`; `keep`: torch keeps the captured graph too, to be
        cloned for the other slot."""
        graph = self.capture_work(runner, lambda: runner.compute_step(slot, shape), keep)
        self.graphs[self.key(slot.index, shape)] = graph
        return graph

    def capture_work(self, runner, work: Callable[[], None], keep: bool = False) -> torch.cuda.CUDAGraph:
        """A graph of `work` (device work on the compute stream) in the shared pool; `keep`:
        torch keeps the captured graph too, to be cloned for the other slot."""
        graph = torch.cuda.CUDAGraph(keep_graph=keep)
        with torch.cuda.graph(graph, pool=self.pool, stream=runner.streams.compute):
            work()
        if keep:
            graph.instantiate()
        return graph

    def _clone(self, runner, graph, slot, shape: StepShape) -> bool:
        """`slot`'s graph of the step, cloned from the other slot's `graph` (a torch graph
        captured with keep_graph=True); whether that worked."""
        cloned = self.clone_for_other_slot(graph)
        if cloned is None:
            return False
        self.graphs[self.key(slot.index, shape)] = cloned
        return True

    def clone_for_other_slot(self, graph) -> ClonedGraph | None:
        """The other slot's copy of `graph` (a torch graph captured with keep_graph=True), or
        None (no cloner, a graph not kept, or a node the cloner cannot re-point)."""
        if self.cloner is None or not isinstance(graph, torch.cuda.CUDAGraph):
            return None
        try:
            graph.raw_cuda_graph()
        except RuntimeError:  # (captured without keep_graph)
            return None
        return self.cloner.clone(graph)


def _warmup_group(shape: StepShape) -> tuple:
    """Shapes whose kernels compile alike: Triton specialises integer arguments on == 1 and
    on divisibility by 16, and the decode attention changes its launch past 128 rows; the
    step kind, sampler variant and split count select kernels too."""
    n = shape.num_seqs if shape.is_decode else shape.num_tokens
    return (shape.is_decode, shape.flags, shape.decode_splits, n == 1, n % 16 == 0, n > 128)


def _first_at_least(sizes: list[int], n: int) -> int | None:
    for size in sizes:
        if size >= n:
            return size
    return None
