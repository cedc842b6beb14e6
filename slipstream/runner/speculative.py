"""Speculative decoding's device half: the verification step of a batch with drafts.

A batch whose sampling rows carry drafts (ScheduledBatch.spec) has 1 + m query tokens a
drafting row (its last token, then its m drafts).  A verify batch (every row samples, none has
more than k + 1 tokens) runs its attention in the verify kernel, and padded to a graph's rows
under a CUDA graph where one applies (runner/verify_graphs.py, `verify_step`); a batch with a
prompt chunk runs as an eager mixed step, the drafting rows through the prefill attention's
causal mask.  After the forward pass:

1. every sampling row draws its token as in a plain step (`ModelRunner.sample`, from the
   logits of its last query token): the token of the rows without drafts, and the
   sampler's state (penalty counts) as usual;
2. the drafting rows' logits at all their k + 1 query positions (positions past a row's
   m + 1 repeat its last one and are never read) become the target distribution of each
   position (`processed_logits`: penalties with the drafts before the position counted,
   temperature, top-k, top-p, min-p, exactly what the sampler draws from), and
   `spec.rejection.rejection_sample` accepts a prefix of the drafts and draws the token
   after it (greedy rows: the drafts equal to the argmax); point-mass drafts without
   penalties skip the distribution: the sampler draws every position itself and a draft is
   accepted iff it is the draw (runner/acceptance.py, the same rule);
3. the slot's `tokens` row of a drafting row becomes its last emitted token (the penalty
   counts take its emitted tokens instead of step 1's draw), and the emitted tokens
   [S, k + 1], their counts [S] and, when asked, their logprobs are copied out beside the
   tokens.

With device drafting (asynchronous scheduling) the drafts are made on the GPU first
(runner/spec_device.py).

A draw at output index i of a request uses the noise of (its seed, i), as every draw does,
so seeded runs are reproducible and do not depend on the batch.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np
import torch

from slipstream.runner.acceptance import emit_point_mass, synthetic_from_target, write_emitted
from slipstream.runner.inputs import fill_inputs
from slipstream.runner.prompt_logprobs import step_prompt_spans
from slipstream.runner.slots import MAX_LOGPROBS
from slipstream.runner.spec_device import DeviceDraftInputs, prepare_device_drafts, to_device
from slipstream.runner.verify_graphs import VerifyInputs, verify_graphs, verify_inputs, verify_route, verify_shape
from slipstream.sampling.columns import ALL_COLUMNS
from slipstream.sampling.sampler import GREEDY_EPS, SamplingTensors, processed_logits, sample


@dataclass
class SpecBuffers:
    """One slot's verification outputs: emitted tokens and their counts, device and host."""
    tokens: torch.Tensor  # int32 [max_seqs, k + 1]
    num_emitted: torch.Tensor  # int32 [max_seqs]
    drafted: torch.Tensor  # int32 [max_seqs]: drafts each row verified
    host_tokens: torch.Tensor
    host_num_emitted: torch.Tensor
    host_drafted: torch.Tensor
    # logprobs of the emitted tokens (rows asking for them): float32 [max_seqs, k + 1, 1 + n]
    # (the token's, then the top n) and int32 [max_seqs, k + 1, n] ids, device then host
    logprobs: torch.Tensor | None = None
    logprob_ids: torch.Tensor | None = None
    host_logprobs: torch.Tensor | None = None
    host_logprob_ids: torch.Tensor | None = None

    @classmethod
    def new(cls, max_seqs: int, k: int, device: torch.device) -> "SpecBuffers":
        pin = device.type == "cuda"
        tokens = torch.full((max_seqs, k + 1), -1, dtype=torch.int32, device=device)
        num = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        lps = torch.zeros(max_seqs, k + 1, 1 + MAX_LOGPROBS, dtype=torch.float32, device=device)
        ids = torch.zeros(max_seqs, k + 1, MAX_LOGPROBS, dtype=torch.int32, device=device)
        return cls(tokens, num, torch.zeros_like(num), torch.zeros(tokens.shape, dtype=torch.int32, pin_memory=pin),
                   torch.zeros(num.shape, dtype=torch.int32, pin_memory=pin),
                   torch.zeros(num.shape, dtype=torch.int32, pin_memory=pin),
                   lps, ids, torch.zeros(lps.shape, dtype=torch.float32, pin_memory=pin),
                   torch.zeros(ids.shape, dtype=torch.int32, pin_memory=pin))

    def download_logprobs(self, S: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.host_logprobs[:S, :, :1 + n].copy_(self.logprobs[:S, :, :1 + n], non_blocking=True)
        self.host_logprob_ids[:S, :, :n].copy_(self.logprob_ids[:S, :, :n], non_blocking=True)
        return self.host_logprobs[:S, :, :1 + n], self.host_logprob_ids[:S, :, :n]

    def download(self, S: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copy the first S rows out (current stream); the pinned host views."""
        out = []
        for dev, host in ((self.tokens, self.host_tokens), (self.num_emitted, self.host_num_emitted),
                          (self.drafted, self.host_drafted)):
            host[:S].copy_(dev[:S], non_blocking=True)
            out.append(host[:S])
        return tuple(out)


def spec_buffers(runner, slot_index: int, k: int) -> SpecBuffers:
    """The slot's buffers, made at the first batch with drafts (none for plain engines)."""
    bufs = getattr(runner, "spec_buffers", None)
    if bufs is None or bufs[0].tokens.shape[1] != k + 1:
        bufs = [SpecBuffers.new(runner.opts.max_num_seqs, k, runner.device) for _ in runner.slots]
        runner.spec_buffers = bufs
    return bufs[slot_index]


def launch_speculative(runner, batch, launched_cls):
    """`ModelRunner.launch` for a batch with drafts: upload, the verification step, download,
    on the runner's three streams like any step; returns a `launched_cls`.  A verify batch
    (runner/verify_graphs.py) runs its attention in the verify kernel, and padded to a
    graph's rows under that graph where one applies."""
    slot = runner.slots[batch.batch_id % 2]
    slot.h2d_done.synchronize()
    # device drafting: a step that only shifts rows after a verification (no draft slots of
    # its own) keeps the verify layout, so that it replays the verify graph too
    route = verify_route(runner, batch, single_token_rows=batch.spec.shift_src is not None)
    shape = fill_inputs(batch, slot.host, runner.block_size, route.pad if route else None, runner.max_model_len,
                        verify=route is not None)
    if route is not None:
        shape = verify_shape(runner, slot, shape, route, batch.num_seqs)
    graphs = verify_graphs(runner) if route is not None and route.pad is not None else None
    if graphs is not None and graphs.applies(shape, batch, batch.spec):
        return _launch_padded(runner, batch, slot, shape, graphs, launched_cls)
    spans = step_prompt_spans(batch, slot.host.query_start_loc)
    S, spec = len(batch.sampled), batch.spec
    bufs = spec_buffers(runner, slot.index, spec.k)
    device_drafting = spec.draft_tokens is None
    launched = launched_cls(batch, slot, S, shape.flags.num_logprobs)
    s, dev = runner.streams, runner.device
    with s.uploading(slot):
        slot.upload(shape.num_seqs)
        verify_in, uploaded, dd_in = upload_verify_inputs(batch, slot, dev)
    with s.computing(slot, uploaded):
        for row, prompt, outputs in batch.penalty_resets:
            runner.penalties.reset_row(row, prompt, outputs)
        draft_probs = stack_draft_probs(spec.draft_probs, spec.k, s) if spec.draft_probs else None
        if device_drafting:
            prev = spec_buffers(runner, 1 - slot.index, spec.k)
            verify_in += prepare_device_drafts(runner, slot, _unpadded(shape, batch), spec, dd_in, prev.num_emitted)
        hidden = runner.forward_hidden(slot, shape)
        launched.prompt_logprobs = runner.prompt_logprobs(hidden, spans) if spans else None
        logits = runner.logits(slot, shape, hidden)
        suppress_tokens(batch, logits, dev)
        runner.sample(slot, shape, logits)
        verify(runner, slot, shape, hidden, bufs, S, *verify_in, draft_probs=draft_probs,
               synthetic_accept=spec.bench_synthetic_accept)
    download_verified(runner, slot, launched, bufs, S)
    return launched


def upload_device_drafts(batch, slot, dev) -> DeviceDraftInputs:
    """On the h2d stream, a padded step's device-drafting inputs: those of its drafting rows
    (the rows with draft slots), whose indices are `verify_rows`."""
    return DeviceDraftInputs.upload(batch, slot.host, np.flatnonzero(batch.spec.num_drafts > 0), dev)


def upload_verify_inputs(batch, slot, dev):
    """On the h2d stream: the drafting rows' indices and the positions of their k + 1 query
    tokens in the step (the last one repeated past a row's drafts), then either the device
    drafting inputs or the host's drafts; returns (verify inputs, every tensor uploaded,
    the device drafting inputs or None)."""
    spec, S = batch.spec, len(batch.sampled)
    rows = np.flatnonzero(spec.num_drafts > 0)
    last = slot.host.logits_indices[:S][rows].astype(np.int64)
    nd = spec.num_drafts[rows].astype(np.int64)
    cols = np.minimum(np.arange(spec.k + 1)[None, :], nd[:, None])
    positions = last[:, None] - nd[:, None] + cols
    verify_in = (to_device(rows.astype(np.int64), dev), to_device(positions.ravel(), dev))
    if spec.draft_tokens is None:
        dd_in = DeviceDraftInputs.upload(batch, slot.host, rows, dev)
        return verify_in, verify_in + dd_in.tensors(), dd_in
    verify_in += (to_device(spec.draft_tokens[rows], dev), to_device(spec.num_drafts[rows], dev))
    return verify_in, verify_in, None


def suppress_tokens(batch, logits: torch.Tensor, dev) -> None:
    """-inf at the tokens each row may not draw yet (its stop tokens before min_tokens)."""
    if batch.suppress:
        r = [j for j, ids in batch.suppress for _ in ids]
        c = [t for _, ids in batch.suppress for t in ids]
        logits[to_device(r, dev, torch.long), to_device(c, dev, torch.long)] = float("-inf")


def _unpadded(shape, batch):
    """The batch's real sizes (device drafting moves the real tokens and rows only)."""
    return replace(shape, num_tokens=int(np.sum(batch.num_new)), num_seqs=batch.num_seqs,
                   num_samples=len(batch.sampled))


def _launch_padded(runner, batch, slot, shape, graphs, launched_cls):
    """A verify batch padded to a graph's rows: `verify_step` over every padded row, its
    graph replayed where captured (runner/verify_graphs.py)."""
    S, spec = len(batch.sampled), batch.spec
    P = shape.num_seqs
    bufs = spec_buffers(runner, slot.index, spec.k)
    vin = verify_inputs(runner, slot.index, spec.k)
    device_drafting = spec.draft_tokens is None
    launched = launched_cls(batch, slot, S, shape.flags.num_logprobs)
    s, dev = runner.streams, runner.device
    uploaded: tuple[torch.Tensor, ...] = ()
    with s.uploading(slot):
        slot.upload(P)
        vin.upload(spec, P)
        if device_drafting:
            dd_in = upload_device_drafts(batch, slot, dev)
            uploaded = dd_in.tensors()
    with s.computing(slot, uploaded):
        if device_drafting:  # the input correction, before the graph
            place_device_drafts(runner, slot, shape, batch, dd_in, vin)
        synthetic = spec.bench_synthetic_accept
        if not graphs.run(runner, slot, shape, synthetic,
                          lambda: verify_step(runner, slot, shape, bufs, vin, synthetic), runner.spec_buffers):
            verify_step(runner, slot, shape, bufs, vin, synthetic)
    download_verified(runner, slot, launched, bufs, S)
    return launched


def place_device_drafts(runner, slot, shape, batch, dd_in: DeviceDraftInputs, vin: VerifyInputs) -> None:
    """The padded step's input correction on the compute stream: the drafts buffered at the
    end of the other slot's step (and their count) into the static verify inputs of the
    drafting rows (`dd_in.verify_rows`)."""
    spec = batch.spec
    prev = spec_buffers(runner, 1 - slot.index, spec.k)
    prepare_device_drafts(runner, slot, _unpadded(shape, batch), spec, dd_in, prev.num_emitted,
                          into=(vin.dev, dd_in.verify_rows))


def verify_step(runner, slot, shape, bufs: SpecBuffers, vin: VerifyInputs, synthetic_accept: float | None,
                draft_probs: torch.Tensor | None = None, capture=None):
    """The padded verify step on the compute stream (eager, or captured): the forward, the LM
    head once over every row's k + 1 verified positions, and the acceptance of every row's
    drafts; fixed shapes, no host reads.  No plain draw: the acceptance draws every position
    as the plain sampler would (spec/rejection.py), so a row without drafts emits the token
    drawn at its one position, the plain draw's, and every row's slot token is its last
    emitted one.  (Penalties and logprobs, which need the plain draw, are not on this path.)
    A device drafter's step (runner/draft_graphs.py) passes its q [P, k, V] (`draft_probs`)
    and `capture`, a context around the forward (what the drafter reads of it), whose value
    is returned."""
    P, K1 = shape.num_seqs, shape.verify_len
    with capture() if capture is not None else nullcontext() as aux:
        hidden = runner.forward_hidden(slot, shape)
    last = slot.dev.logits_indices[:P].long()
    nd = vin.slots[:P].long()
    cols = torch.minimum(torch.arange(K1, device=last.device)[None, :], nd[:, None])
    positions = (last[:, None] - nd[:, None] + cols).reshape(-1)
    logits = runner.model.compute_logits(hidden.index_select(0, positions))
    rows = torch.arange(P, device=last.device)
    verify(runner, slot, shape, hidden, bufs, P, rows, positions, vin.drafts[:P], vin.num_drafts[:P],
           draft_probs=draft_probs, synthetic_accept=synthetic_accept, logits=logits)
    return aux


def download_verified(runner, slot, launched, bufs: SpecBuffers, S: int) -> None:
    """On the d2h stream, after the step: the slot's outputs and the emitted tokens."""
    s = runner.streams
    with s.on(s.d2h):
        s.wait(s.d2h, slot.compute_done)
        slot.d2h_start.record()
        slot.download(S, launched.num_logprobs)
        launched.spec_out = bufs.download(S)
        if launched.num_logprobs:
            launched.spec_logprobs = bufs.download_logprobs(S, launched.num_logprobs)
        slot.d2h_done.record()


def _penalty_state_per_position(pen, state_rows: torch.Tensor, drawn: torch.Tensor, drafts: torch.Tensor,
                                num_drafts: torch.Tensor) -> SimpleNamespace:
    """The penalty state each of a drafting row's k + 1 positions sees (one row a position):
    its counts plus the drafts before the position, which are its outputs if accepted.  The
    plain draw of the step (`ModelRunner.sample`, at the row's last position) recorded a token
    that is not the row's: it is taken back out of the counts."""
    V = pen.vocab_size
    ones = torch.ones_like(drawn, dtype=torch.int32)
    pen.output_counts.view(-1).scatter_add_(0, state_rows * V + drawn.long(), -ones)
    R, k = drafts.shape
    counts = pen.output_counts.index_select(0, state_rows).repeat_interleave(k + 1, dim=0)  # [R * (k + 1), V]
    i = torch.arange(k + 1, device=drafts.device)[None, :, None]
    j = torch.arange(k, device=drafts.device)[None, None, :]
    before = ((j < i) & (j < num_drafts.long()[:, None, None])).to(torch.int32)  # [R, k + 1, k]
    at = torch.arange(R * (k + 1), device=drafts.device).view(R, k + 1, 1) * V + drafts.long().clamp(min=0)[:, None, :]
    counts.view(-1).scatter_add_(0, at.reshape(-1), before.reshape(-1))
    return SimpleNamespace(output_counts=counts,
                           prompt_mask=pen.prompt_mask.index_select(0, state_rows).repeat_interleave(k + 1, dim=0))


def stack_draft_probs(probs: list, k: int, streams) -> torch.Tensor:
    """A draft model's q of each drafting row ([m, V] each) as one [R, k, V] tensor, on the
    compute stream; the padding past a row's m drafts is never read.  The q were made on the
    default stream, which the host has waited for (it read the drafts)."""
    if streams.cuda:
        for q in probs:
            q.record_stream(streams.compute)
    out = probs[0].new_zeros(len(probs), k, probs[0].shape[-1])
    for r, q in enumerate(probs):
        out[r, :q.shape[0]] = q
    return out


def verify(runner, slot, shape, hidden: torch.Tensor, bufs: SpecBuffers, S: int, rows: torch.Tensor,
           positions: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
           draft_probs: torch.Tensor | None = None, synthetic_accept: float | None = None,
           logits: torch.Tensor | None = None) -> None:
    """Rejection-sample the drafting rows (`rows`, sampling-row indices) and write every
    sampling row's emitted tokens into `bufs` (a row without drafts: the token it drew).
    `draft_probs` [R, k, V]: a sampling drafter's q (None: point-mass drafts);
    `synthetic_accept`: the bench's synthetic acceptance (runner/acceptance.py);
    `logits`: the model's logits at `positions`, when the caller has them."""
    from slipstream.spec.rejection import rejection_sample

    d = slot.dev
    R, K1 = drafts.shape[0], drafts.shape[1] + 1
    every_row = R == S  # (rows is then 0..S-1, sorted: every row's outputs are written below)
    if not every_row:
        bufs.tokens[:S].fill_(-1)
        bufs.tokens[:S, 0].copy_(d.tokens[:S])
        bufs.num_emitted[:S].fill_(1)
        bufs.drafted[:S].zero_()
    if R == 0:  # (device drafting: a step that only shifts rows)
        return
    if logits is None:
        logits = runner.model.compute_logits(hidden.index_select(0, positions))

    def of_rows(column: torch.Tensor) -> torch.Tensor:  # a sampling-row column [S] -> [R]
        return column[:S] if every_row else column[:S].index_select(0, rows)

    cols = {c.name: of_rows(getattr(d, c.name)).repeat_interleave(K1) for c in ALL_COLUMNS}
    token_index = (of_rows(d.token_index)[:, None]
                   + torch.arange(K1, device=rows.device, dtype=torch.int32)[None, :]).reshape(-1)
    state_rows = of_rows(d.state_row)
    t = SamplingTensors(token_index=token_index, state_row=state_rows.repeat_interleave(K1), **cols)
    state = runner.penalties
    outputs = (bufs.tokens[:S], bufs.num_emitted[:S], bufs.drafted[:S], d.tokens[:S])
    if draft_probs is None and not shape.flags.use_penalties:
        # point-mass drafts: the acceptance compares each draft with the target's own draw at
        # its position (spec/rejection.py), which the plain sampler makes here directly from
        # the logits (no processed distribution: a few vocabulary-wide passes less)
        drawn = sample(logits, t, replace(shape.flags, num_logprobs=0), state).tokens.view(R, K1)
        emit_point_mass(drawn, drafts, num_drafts, rows, d.seed[:S], d.token_index[:S], synthetic_accept, *outputs)
        out = of_rows(bufs.tokens) if shape.flags.num_logprobs else None  # (read back for the logprobs)
    else:
        if shape.flags.use_penalties:
            state = _penalty_state_per_position(runner.penalties, state_rows.long(), of_rows(d.tokens), drafts,
                                                num_drafts)
            t.state_row = torch.arange(R * K1, dtype=torch.int32, device=rows.device)
        target = processed_logits(logits, t, shape.flags, state).view(R, K1, -1)
        greedy = cols["temperature"].view(R, K1)[:, 0] < GREEDY_EPS
        seed, index0 = cols["seed"].view(R, K1)[:, 0], token_index.view(R, K1)[:, 0]
        out, num = rejection_sample(target, drafts, num_drafts, draft_probs, greedy, seed=seed, token_index=index0)
        if synthetic_accept is not None:
            out, num = synthetic_from_target(target, drafts, num_drafts, greedy, seed, index0, synthetic_accept)
        write_emitted(out, num, num_drafts, rows, *outputs)
    if shape.flags.use_penalties:  # the emitted tokens count from the next step on
        V = runner.penalties.vocab_size
        flat = state_rows.long()[:, None] * V + out.clamp(min=0).long()
        runner.penalties.output_counts.view(-1).scatter_add_(0, flat.reshape(-1), (out >= 0).to(torch.int32).reshape(-1))
    n = shape.flags.num_logprobs
    if n:  # the model's distribution at each position (as the sampler's logprobs), emitted tokens
        lp = torch.log_softmax(logits.float(), dim=-1)
        chosen = lp.gather(1, out.clamp(min=0).long().reshape(-1, 1))
        top, top_ids = lp.topk(n, dim=-1)
        bufs.logprobs[:S, :, :1 + n].index_copy_(0, rows, torch.cat([chosen, top], dim=1).view(R, K1, 1 + n))
        bufs.logprob_ids[:S, :, :n].index_copy_(0, rows, top_ids.to(torch.int32).view(R, K1, n))
