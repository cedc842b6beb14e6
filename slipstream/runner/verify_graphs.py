"""The verification step of speculative decoding in the decode attention kernel, and under
CUDA graphs.

A batch with drafts whose every row is a sampling row with at most k + 1 new tokens (its
last token and its drafts: no prompt chunk in the batch) is a verify batch: its attention
runs in the split-KV verify kernel (`AttentionMetadata.verify_len` = k + 1,
ops/triton_verify_kernel.py; on the CPU the reference attention, which takes any query
length), not through the prefill kernel's causal tiles.  `verify_route` says whether a batch
is one and how it is laid out.

With CUDA graphs the batch is padded to a decode graph's row count P and P x (k + 1) tokens
(padding rows own no token and have no context; a row with fewer drafts has fewer tokens,
which the kernel reads from query_start_loc), and one graph per (slot, P, k, sampler
variant, decode split count, all-greedy, synthetic acceptance) runs the forward, the LM head on all
P x (k + 1) verified positions and the acceptance (spec/rejection.py) on the device
(`runner.speculative.verify_step`).  Its inputs besides the slot's are two static per-slot buffers:
each row's drafts and their count (`VerifyInputs`), written before the replay.  Under
asynchronous scheduling the GPU-side input correction (runner/spec_device.py: the shift by
the previous step's accepted counts, the carry-over, the device drafting) runs eagerly on the
compute stream before the replay and writes the slot's inputs and these buffers.

A graph is captured at its key's second use (the first runs eagerly and compiles the verify
kernel and the sampler's variants) and cloned for the second slot as the step graphs are, the
cloner mapping the slots' verify buffers (SpecBuffers, VerifyInputs) too; one eager run a
key on either slot compiles its kernels, so the other slot's first use captures (or clones).
Penalties, logprobs, a drafter's probabilities (draft model, EAGLE-3), suppressed tokens,
prompt logprobs and penalty resets run the same layout eagerly.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from slipstream.runner.inputs import StepPad, StepShape


@dataclass(frozen=True)
class VerifyRoute:
    """How a verify batch runs: its pad (None: unpadded, eager) and k + 1."""
    pad: StepPad | None
    q_len: int


def verify_route(runner, batch, single_token_rows: bool = False) -> VerifyRoute | None:
    """The verify-kernel route of a batch with drafts, or None (a prompt chunk or a row that
    does not sample is in it, or no row has more than one token: the mixed step's kernels).
    `single_token_rows`: a batch whose every row has one token takes it too (a device
    drafter's decode step with no draft slots, near the end of the context: its drafter runs
    every step, and the drafting graph already captured for the k + 1 layout serves it)."""
    spec = batch.spec
    q_len = spec.k + 1
    n = np.asarray(batch.num_new)
    if (batch.num_seqs != len(batch.sampled) or n.size == 0 or n.max() > q_len
            or (n.max() <= 1 and not single_token_rows)):
        return None
    if not np.array_equal(np.asarray(batch.sample_seq), np.arange(batch.num_seqs)):
        return None
    pad = None
    graphs = getattr(runner, "graphs", None)
    if graphs is not None:
        p = graphs.padding(batch.num_seqs, batch.num_seqs, True)
        if p is not None and p.num_seqs * q_len <= runner.slots[0].host.input_ids.shape[0]:
            pad = StepPad(p.num_seqs * q_len, p.num_seqs)
    return VerifyRoute(pad, q_len)


def verify_shape(runner, slot, shape: StepShape, route: VerifyRoute, num_rows: int) -> StepShape:
    """The step's shape on the verify route (fill_inputs laid it out as a mixed step): the
    verify kernel's q_len, rows longest first, and the decode split count of its rows."""
    host = slot.host
    B = shape.num_seqs
    host.decode_order[:B] = np.argsort(-host.seq_lens[:B], kind="stable")
    return replace(shape, max_query_len=route.q_len, num_decode=0, verify_len=route.q_len,
                   decode_splits=runner.decode_splits(host, num_rows, B))


class VerifyInputs:
    """One slot's static verify inputs, a row a sampling row: its drafts, their count (what
    the acceptance may take) and its draft slots in the step (k under device drafting, else
    the count); device int32 [max_seqs, k + 2] (the graph reads it) and its pinned host copy."""

    def __init__(self, max_seqs: int, k: int, device: torch.device) -> None:
        self.k = k
        self.dev = torch.zeros(max_seqs, k + 2, dtype=torch.int32, device=device)
        self.host = torch.zeros(max_seqs, k + 2, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.drafts, self.num_drafts, self.slots = self.dev[:, :k], self.dev[:, k], self.dev[:, k + 1]

    def upload(self, spec, P: int) -> None:
        """The padded rows' drafts and counts (current stream); under device drafting the
        slot counts only (the drafts are the GPU's: `prepare_device_drafts` writes them here)."""
        S, k = len(spec.num_drafts), self.k
        h = self.host[:P].numpy()
        h[:] = 0
        if spec.draft_tokens is not None:
            h[:S, :k] = spec.draft_tokens
            h[:S, k] = spec.num_drafts
        h[:S, k + 1] = spec.num_drafts
        self.dev[:P].copy_(self.host[:P], non_blocking=True)


def verify_inputs(runner, slot_index: int, k: int) -> VerifyInputs:
    bufs = getattr(runner, "verify_inputs", None)
    if bufs is None or bufs[0].k != k:
        bufs = [VerifyInputs(runner.opts.max_num_seqs, k, runner.device) for _ in runner.slots]
        runner.verify_inputs = bufs
    return bufs[slot_index]


class VerifyGraphs:
    """The verify steps' CUDA graphs, in the step graphs' pool (runner/graphs.py)."""

    def __init__(self, steps) -> None:
        self.steps = steps
        self.graphs: dict[tuple, object] = {}
        self.seen: set[tuple] = set()
        self.replays = [0, 0]  # per slot
        self.cloner = None  # the step graphs' cloner with the verify buffers mapped too (`_clone`)

    @staticmethod
    def key(slot_index: int, shape: StepShape, synthetic_accept: float | None) -> tuple:
        return (slot_index, shape.num_seqs, shape.verify_len, shape.flags.use_top_k_top_p, shape.decode_splits,
                shape.greedy, synthetic_accept)

    @staticmethod
    def applies(shape: StepShape, batch, spec) -> bool:
        f = shape.flags
        return (shape.padded and not f.use_penalties and not f.num_logprobs and not batch.suppress
                and not batch.penalty_resets and not batch.prompt_logprobs and not spec.draft_probs)

    def _clone(self, runner, other, spec_bufs: list, extra: list | None = None) -> object | None:
        """The other slot's copy of `other`: the step graphs' cloning with the verify step's
        own per-slot buffers (each slot's SpecBuffers and VerifyInputs, and `extra[i]`, slot
        i's further device tensors) mapped too, so the copy reads and writes the other slot's."""
        steps = self.steps
        if steps.cloner is None or not isinstance(other, torch.cuda.CUDAGraph):
            return None
        from slipstream.runner.graph_clone import AddressMap, SlotGraphCloner

        def buffers(i: int) -> list[tuple[int, int]]:
            own = [t for t in vars(spec_bufs[i]).values() if isinstance(t, torch.Tensor) and t.is_cuda]
            own.append(runner.verify_inputs[i].dev)
            own += extra[i] if extra else []
            return runner.slots[i].device_buffers() + [(t.data_ptr(), t.numel() * t.element_size()) for t in own]

        if self.cloner is None:
            self.cloner = SlotGraphCloner(runner.slots)
        self.cloner.map = AddressMap.swap(buffers(0), buffers(1))
        try:
            other.raw_cuda_graph()
        except RuntimeError:  # (captured without keep_graph)
            return None
        return self.cloner.clone(other)

    def run(self, runner, slot, shape: StepShape, synthetic_accept: float | None, work: Callable[[], None],
            spec_bufs: list | None = None, extra: list | None = None) -> bool:
        """Replay (capturing `work`, the step, first where due) the graph of this verify step;
        False: the caller runs the step eagerly.  On the compute stream, inputs in place.
        `extra`: per slot, the step's further per-slot device tensors (cloning maps them)."""
        if self.steps.pool is None:
            return False
        key = self.key(slot.index, shape, synthetic_accept)
        if key not in self.graphs:
            other_key = (1 - key[0],) + key[1:]
            other = self.graphs.get(other_key)
            # one eager run of the step a key, on either slot, compiles its kernels: the
            # other slot captures (or copies) its graph at its own first use
            if key not in self.seen and other_key not in self.seen and other is None:
                self.seen.add(key)
                return False
            start = time.perf_counter()
            graph = self._clone(runner, other, spec_bufs, extra) if other is not None and spec_bufs else None
            if graph is None:
                graph = self.steps.capture_work(runner, work, keep=self.steps.cloner is not None)
            self.graphs[key] = graph
            self.steps.capture_s += time.perf_counter() - start
        self.graphs[key].replay()
        self.replays[slot.index] += 1
        return True


def verify_graphs(runner) -> VerifyGraphs | None:
    if getattr(runner, "graphs", None) is None:
        return None
    g = getattr(runner, "verify_graphs", None)
    if g is None:
        g = runner.verify_graphs = VerifyGraphs(runner.graphs)
    return g
