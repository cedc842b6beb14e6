"""CUDA graphs of a device drafter's step (EAGLE-3, a draft model: runner/device_drafter.py).

Such an engine's step is the verification step plus the drafter's work (runner/draft_step.py).
A decode-only batch (every row samples and has at most k + 1 query tokens: its last token
and its draft slots, no prompt chunk) is laid out as the n-gram verification graphs lay
theirs (runner/verify_graphs.py): padded to a decode graph's row count P and P x (k + 1)
tokens, its attention in the verify kernel.  One graph per
(slot, P, k, sampler variant, decode split count, all-greedy, synthetic acceptance) then holds the
step's whole device work, `drafting_step`: the target's forward under the drafter's
`capture` (EAGLE-3 reads three of its hidden states), the LM head over every row's k + 1
positions, the acceptance with the drafter's q, the drafter's extend over the step's tokens
and its k draft forwards with their draws (`DeviceDrafter.after_step`), so a step is one
replay with no host work per draft.

Its inputs are static: the slot's, the verify inputs (`VerifyInputs`: drafts, counts, draft
slots) and `DraftGraphInputs` (each row's first query token, its draft slots and its
request-table row; each token's request-table row), written by the h2d stream.  The drafter's
q is read from its buffers inside the graph (`DeviceDrafter.probs` at the rows' request-table
rows: what the synchronous loop's host drafts point at too).  Padding rows are harmless: no
context, draft slots -1 (the extend writes their emitted tokens nowhere), request-table row
the scratch row (their drafts and q land in its buffers, their draft forwards in its KV);
padding tokens store no KV (token row -1).

Eager, on the compute stream before the replay: under asynchronous scheduling the input
correction (`prepare_device_drafts`: shift, carry-over, the buffered drafts into the verify
inputs), and the draft model's catch-up (host-sized).

The graph is captured at its key's second use (the first runs `drafting_step` eagerly,
compiling its kernels) into the engine's one graph pool and cloned for the other slot
(the cloner maps these inputs too).  Without CUDA graphs on a CPU the same padded layout
and `drafting_step` run eagerly (unless enforce_eager), so the CPU runs the code the GPU
captures.  Other steps of such an engine stay eager (runner/draft_step.py): a prompt chunk,
a row that does not sample, penalties, logprobs, suppressed tokens, prompt logprobs, penalty
resets, more rows than the largest decode graph.

A batch whose rows have no draft slots (within 2k + 1 tokens of max_model_len a row gets
none) takes the same layout and the same graph, each row one real token: its drafter still
runs, and an eager step there would cost the host the whole step's launches (on a GPU, also
the first compiles of kernels at shapes no graph ran), while a decode step's key stays the
same as the context grows (at one row the split count is the policy's for any length), so a
steady batch-1 decode replays one graph a slot from its second step to the context's end
(tests/test_spec_draft_graph_keys.py).
"""
from __future__ import annotations

import numpy as np
import torch

from slipstream.runner.device_drafter import DraftStepInputs
from slipstream.runner.graphs import capture_sizes
from slipstream.runner.inputs import StepPad, StepShape, fill_inputs
from slipstream.runner.speculative import (download_verified, place_device_drafts, spec_buffers,
                                           upload_device_drafts, verify_step)
from slipstream.runner.verify_graphs import (VerifyGraphs, VerifyInputs, VerifyRoute, verify_inputs, verify_route,
                                             verify_shape)


class DraftGraphInputs:
    """One slot's static drafter inputs of a padded step (a `DraftStepInputs` of views):
    int64 device [3 x max_seqs + max_tokens] (first query token, draft slots, request-table
    row of each row; request-table row of each token) and its pinned host copy."""

    def __init__(self, max_seqs: int, max_tokens: int, device: torch.device) -> None:
        m = self.max_seqs = max_seqs
        self.dev = torch.zeros(3 * m + max_tokens, dtype=torch.int64, device=device)
        self.host = torch.zeros(self.dev.shape, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.first, self.num_slots, self.seq_rows = self.dev[:m], self.dev[m:2 * m], self.dev[2 * m:3 * m]
        self.token_rows = self.dev[3 * m:]
        self.none = torch.zeros(0, dtype=torch.int64, device=device)  # (no prompt rows in such a step)

    def upload(self, batch, host, P: int, PT: int, scratch_row: int) -> None:
        """The padded step's values (current stream); padding rows: first 0, draft slots -1,
        the scratch row; padding tokens: row -1."""
        m, h = self.max_seqs, self.host.numpy()
        B = batch.num_seqs  # (every row samples, in order)
        qsl = host.query_start_loc[:B + 1].astype(np.int64)
        num_slots = np.asarray(batch.spec.num_drafts, np.int64)
        h[:P], h[m:m + P], h[2 * m:2 * m + P] = 0, -1, scratch_row
        h[:B] = host.logits_indices[:B].astype(np.int64) - num_slots
        h[m:m + B] = num_slots
        h[2 * m:2 * m + B] = batch.rows
        tokens = h[3 * m:3 * m + PT]
        tokens[:] = -1
        tokens[:qsl[-1]] = np.repeat(np.asarray(batch.rows, np.int64), np.diff(qsl))
        self.dev[:3 * m].copy_(self.host[:3 * m], non_blocking=True)
        self.dev[3 * m:3 * m + PT].copy_(self.host[3 * m:3 * m + PT], non_blocking=True)

    def inputs(self, P: int, PT: int) -> DraftStepInputs:
        return DraftStepInputs(self.first[:P], self.num_slots[:P], self.token_rows[:PT], self.seq_rows[:P],
                               self.none, self.none)


class DraftingGraphs:
    """The padded drafting steps: their graphs (None without CUDA graphs: `drafting_step`
    runs eagerly), the padded steps run and the replays, per slot."""

    def __init__(self, graphs: VerifyGraphs | None) -> None:
        self.graphs = graphs
        self.steps = [0, 0]

    @property
    def replays(self) -> list[int]:
        return self.graphs.replays if self.graphs is not None else [0, 0]

    def run(self, runner, slot, shape: StepShape, synthetic_accept: float | None, work) -> None:
        self.steps[slot.index] += 1
        extra = [[g.dev] for g in runner.draft_graph_inputs]
        if self.graphs is None or not self.graphs.run(runner, slot, shape, synthetic_accept, work,
                                                      runner.spec_buffers, extra):
            work()


def drafting_graphs(runner) -> DraftingGraphs:
    g = getattr(runner, "drafting_graphs", None)
    if g is None:
        steps = getattr(runner, "graphs", None)
        g = runner.drafting_graphs = DraftingGraphs(VerifyGraphs(steps) if steps is not None else None)
    return g


def draft_graph_inputs(runner, slot_index: int) -> DraftGraphInputs:
    bufs = getattr(runner, "draft_graph_inputs", None)
    if bufs is None:
        tokens = runner.slots[0].host.input_ids.shape[0]
        bufs = [DraftGraphInputs(runner.opts.max_num_seqs, tokens, runner.device) for _ in runner.slots]
        runner.draft_graph_inputs = bufs
    return bufs[slot_index]


def drafting_route(runner, batch) -> VerifyRoute | None:
    """A padded route for a device drafter's batch, or None (it runs eagerly): the verify
    route's pad (rows without draft slots too), or without CUDA graphs on a CPU the pad a
    GPU's decode graphs would give."""
    route = verify_route(runner, batch, single_token_rows=True)
    if route is None:
        return None
    opts = runner.opts
    if route.pad is None and getattr(runner, "graphs", None) is None and opts.use_cuda_graphs \
            and runner.device.type != "cuda":
        size = next((s for s in capture_sizes(min(opts.cuda_graph_max_batch, opts.max_num_seqs))
                     if s >= batch.num_seqs), None)
        if size is not None and size * route.q_len <= runner.slots[0].host.input_ids.shape[0]:
            route = VerifyRoute(StepPad(size * route.q_len, size), route.q_len)
    return route if route.pad is not None else None


def _graphable(shape: StepShape, batch) -> bool:
    f = shape.flags
    return (not f.use_penalties and not f.num_logprobs and not batch.suppress and not batch.penalty_resets
            and not batch.prompt_logprobs)


def padded_drafting_shape(runner, batch, slot) -> StepShape | None:
    """The padded shape of a batch that takes `launch_drafting_padded` (its inputs filled
    into the slot's host side), or None."""
    route = drafting_route(runner, batch)
    if route is None:
        return None
    shape = fill_inputs(batch, slot.host, runner.block_size, route.pad, runner.max_model_len, verify=True)
    shape = verify_shape(runner, slot, shape, route, batch.num_seqs)
    return shape if _graphable(shape, batch) else None


def drafting_step(runner, slot, shape: StepShape, bufs, vin: VerifyInputs, gin: DraftGraphInputs,
                  synthetic_accept: float | None) -> None:
    """A padded drafting step's device work on the compute stream (eager, or captured): the
    verify step with the drafter's capture and q, then the drafter's extend and k drafts.
    Fixed shapes, no host reads."""
    drafter = runner.drafter
    P = shape.num_seqs
    # (an all-greedy step's acceptance takes no q, and its drafter writes none)
    probs = None if shape.greedy else drafter.probs.index_select(0, slot.dev.state_row[:P].long())
    aux = verify_step(runner, slot, shape, bufs, vin, synthetic_accept, draft_probs=probs, capture=drafter.capture)
    drafter.after_step(slot, shape, bufs.tokens[:P], bufs.num_emitted[:P], gin.inputs(P, shape.num_tokens), aux)


def launch_drafting_padded(runner, batch, slot, shape: StepShape, launched_cls):
    """`ModelRunner.launch` for a padded drafting step (`padded_drafting_shape`): upload,
    the eager input correction, `drafting_step` (its graph's replay where captured),
    download, on the runner's three streams."""
    S, spec, drafter = len(batch.sampled), batch.spec, runner.drafter
    P, PT = shape.num_seqs, shape.num_tokens
    bufs = spec_buffers(runner, slot.index, spec.k)
    vin = verify_inputs(runner, slot.index, spec.k)
    gin = draft_graph_inputs(runner, slot.index)
    device_drafting = spec.draft_tokens is None
    launched = launched_cls(batch, slot, S, shape.flags.num_logprobs)
    s, dev = runner.streams, runner.device
    uploaded: tuple[torch.Tensor, ...] = ()
    with s.uploading(slot):
        slot.upload(P)
        vin.upload(spec, P)
        gin.upload(batch, slot.host, P, PT, batch.table.scratch_row)
        if device_drafting:
            dd_in = upload_device_drafts(batch, slot, dev)
            uploaded = dd_in.tensors()
        catch_up = drafter.upload_catch_up(batch, dev)
        if catch_up is not None:
            uploaded = uploaded + catch_up.tensors()
    with s.computing(slot, uploaded):
        if device_drafting:  # the input correction, before the graph
            place_device_drafts(runner, slot, shape, batch, dd_in, vin)
        if catch_up is not None:
            drafter.run_catch_up(catch_up)
        drafter.buffers_rewritten()
        synthetic = spec.bench_synthetic_accept
        drafting_graphs(runner).run(runner, slot, shape, synthetic,
                                    lambda: drafting_step(runner, slot, shape, bufs, vin, gin, synthetic))
    download_verified(runner, slot, launched, bufs, S)
    return launched
