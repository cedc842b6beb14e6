"""Drafters that run on the device at the end of every step: the EAGLE-3 head
(runner/eagle3_drafter.py) and the draft model (runner/draft_model.py).  What they share:

- `DraftStepInputs`: the host-known indices of a step, uploaded with its inputs;
- per request-table row buffers: the drafts made at the end of the row's last step, their q
  (float32 [k, V], for rejection sampling) and the target position of the first draft
  (`next_pos`; -1: none).  A step verifies a row's buffered drafts only when that position is
  its first draft slot's, so a row whose previous step ran no drafter (a step with
  speculation disabled, a prefix-cache hit) drafts nothing that step;
- the private, row-contiguous paged KV cache: row r of the request table owns blocks
  [r * B, (r + 1) * B), B = ceil((max_model_len + k) / block_size), so the block table is a
  function of the row: no block pool, no eviction, and the engine's paged attention kernels
  run unchanged.  It costs rows x (max_model_len + k) tokens of the drafter's KV.  The entries
  a drafter writes past a row's accepted tokens (rejected positions, its own drafts) are
  rewritten by the next step's extend before any query reads them: a step's extend starts at
  the row's first unverified position.  A preempted request recomputes its tokens through
  the target, and the drafter's KV with them;
- the draft loop: draft i of each sampling row is drawn from the drafter's distribution
  (temperature-scaled; greedy rows take the argmax) with the drafter's own noise at output
  index (the row's next output + i) (`spec.draft.sample_drafts`), then fed back, one
  decode-shaped forward for all rows at once.  A step whose rows all draw greedily
  (`StepShape.greedy`) takes the argmaxes and keeps no q: its acceptance reads none.

The scheduler's side (`propose`, synchronous loop) reads the buffers once a step; the
asynchronous loop's `prepare_device_drafts` (runner/spec_device.py) takes them on the device
(`device_drafts`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slipstream.ops.metadata import AttentionMetadata
from slipstream.runner.spec_device import to_device
from slipstream.sampling.sampler import GREEDY_EPS
from slipstream.spec.draft import sample_drafts


@dataclass
class DraftStepInputs:
    """Host-known indices of one step, on the device."""
    first: torch.Tensor  # int64 [S]: each sampling row's first query token
    num_slots: torch.Tensor  # int64 [S]: its draft slots (query tokens past the first; -1: a padding row)
    token_rows: torch.Tensor  # int64 [T]: request-table row of each token (-1: a padding token)
    seq_rows: torch.Tensor  # int64 [B]: request-table row of each sequence row
    prompt_at: torch.Tensor  # int64 [P]: the last token of each non-sampling row
    prompt_next: torch.Tensor  # int64 [P]: the prompt token after it

    @classmethod
    def upload(cls, batch, host, num_slots: np.ndarray, device: torch.device) -> DraftStepInputs:
        B, S = batch.num_seqs, len(batch.sampled)
        qsl = host.query_start_loc[:B + 1].astype(np.int64)
        last = qsl[1:] - 1
        first = host.logits_indices[:S].astype(np.int64) - num_slots.astype(np.int64)
        plain = np.ones(B, bool)
        plain[batch.sample_seq[:S]] = False
        seqs = np.flatnonzero(plain)
        nxt_pos = (batch.start + batch.num_new)[seqs].astype(np.int64)
        L = batch.table.token_ids.shape[1]
        nxt = batch.table.token_ids[batch.rows[seqs], np.minimum(nxt_pos, L - 1)].astype(np.int64)

        def dev(a) -> torch.Tensor:
            return to_device(np.ascontiguousarray(a, np.int64), device)

        return cls(dev(first), dev(num_slots), dev(np.repeat(batch.rows, np.diff(qsl))), dev(batch.rows),
                   dev(last[seqs]), dev(np.maximum(nxt, 0)))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.first, self.num_slots, self.token_rows, self.seq_rows, self.prompt_at, self.prompt_next)


class DeviceDrafter:
    """The buffers, the KV layout and the draft loop; a subclass runs its model (`extend`,
    `feed`).  `feed_offset`: how far before a fed token's own position its forward runs
    (EAGLE-3's head reads token t + 1 at position t: 1; a draft model: 0)."""

    feed_offset = 0

    def __init__(self, num_rows: int, max_model_len: int, block_size: int, device: torch.device, k: int,
                 vocab_size: int) -> None:
        self.device, self.k, self.block_size = device, k, block_size
        self.vocab_size = vocab_size
        self.blocks_per_row = -(-(max_model_len + k) // block_size)
        self.num_blocks = num_rows * self.blocks_per_row
        self.drafts = torch.zeros(num_rows, k, dtype=torch.int32, device=device)
        self.probs = torch.zeros(num_rows, k, vocab_size, dtype=torch.float32, device=device)
        self.next_pos = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
        self._host: tuple[np.ndarray, np.ndarray] | None = None  # (drafts, next_pos), sync loop

    # -- the scheduler's side (synchronous loop: the previous step is complete) ---------------
    def forget(self, req) -> None:
        """(A row's buffered drafts are checked against its position when used.)"""

    def propose(self, req, tokens: np.ndarray, limit: int, temperature: float, seed: int,
                token_index: int) -> tuple[np.ndarray, torch.Tensor | None]:
        """The row's buffered drafts (at most `limit`) when they continue `tokens`, else none."""
        if self._host is None:
            self._host = (self.drafts.cpu().numpy(), self.next_pos.cpu().numpy())
        drafts, next_pos = self._host
        if next_pos[req.row] != len(tokens):
            return np.zeros(0, np.int32), None
        return drafts[req.row, :limit].astype(np.int32), self.probs[req.row, :limit]

    # -- the runner's side (compute stream) ---------------------------------------------------
    def device_drafts(self, table_rows: torch.Tensor, first_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Asynchronous loop: the buffered drafts int32 [R, k] and their counts int32 [R] (k
        when they were made for draft position `first_pos`, else 0); their q is
        `probs.index_select(0, table_rows)`."""
        valid = self.next_pos.index_select(0, table_rows) == first_pos.long()
        num = torch.where(valid, self.k, 0).to(torch.int32)
        return self.drafts.index_select(0, table_rows), num

    def meta(self, qsl, seq_lens, table_rows, positions, token_rows, max_query_len, max_seq_len) -> AttentionMetadata:
        """Attention metadata over the private cache: sequences in request-table rows
        `table_rows`, tokens (in rows `token_rows`; -1: a padding token, stored nowhere) at
        `positions`."""
        bs = self.block_size
        table = (table_rows.long()[:, None] * self.blocks_per_row
                 + torch.arange(self.blocks_per_row, device=self.device)[None, :]).to(torch.int32)
        p, r = positions.long(), token_rows.long()
        slots = torch.where(r >= 0, (r * self.blocks_per_row + p // bs) * bs + p % bs, -1)
        return AttentionMetadata(qsl.to(torch.int32), seq_lens.to(torch.int32), table, slots.to(torch.int32),
                                 max_query_len, max_seq_len)

    def upload_catch_up(self, batch, device: torch.device):
        """Tokens the drafter's KV misses before this step's (host-known), uploaded now and run
        by `run_catch_up`; None: none (the base drafter never catches up)."""
        return None

    def run_catch_up(self, catch_up) -> None:
        """Run `upload_catch_up`'s tokens (their KV only; compute stream).  Eager: its sizes are
        the host's, so a captured step (runner/draft_graphs.py) runs it before its replay."""

    def buffers_rewritten(self) -> None:
        """A step's drafting is queued: the synchronous loop's host copy of the buffers is stale
        (a graph replay runs `after_step`'s device work without its Python)."""
        self._host = None

    def capture(self):
        """A context around the target's forward (what the drafter reads of it); its value
        goes to `extend` as `aux`."""
        from contextlib import nullcontext
        return nullcontext()

    def extend(self, slot, shape, out, num_emitted, inp: DraftStepInputs, aux, src: torch.Tensor):
        """Run the drafter over the step's tokens; return (logits [S, V_drafter] of draft 0,
        over the drafter's own vocabulary, the state `feed` carries)."""
        raise NotImplementedError

    def feed(self, tokens: torch.Tensor, positions: torch.Tensor, state, meta: AttentionMetadata):
        """One decode-shaped forward of the drafted tokens: (logits [S, V_drafter] of the next
        draft, state)."""
        raise NotImplementedError

    def target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's ids of drafter-vocabulary ids (a draft model shares the target's)."""
        return ids

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Drafter-vocabulary logits as logits over the target's vocabulary [S, V]."""
        return logits

    @torch.inference_mode()
    def after_step(self, slot, shape, out: torch.Tensor, num_emitted: torch.Tensor, inp: DraftStepInputs,
                   aux, catch_up=None) -> None:
        """Draft k tokens for each sampling row of the step into the buffers.  `out` int32
        [S, k + 1] / `num_emitted` int32 [S]: the rows' emitted tokens (after verification);
        `aux`: what `capture` gathered; `catch_up`: `upload_catch_up`'s.  Fixed shapes and no
        host reads: a captured step runs it (runner/draft_graphs.py), padding rows (num_slots
        -1, in the scratch row) included."""
        self.buffers_rewritten()
        if catch_up is not None:
            self.run_catch_up(catch_up)
        d = slot.dev
        S, k, dev = shape.num_samples, self.k, self.device
        # each row's last accepted query token: the emitted out[num - 1] follows it
        src = inp.first + num_emitted[:S].long() - 1
        logits, state = self.extend(slot, shape, out, num_emitted, inp, aux, src)
        pos = d.positions[:shape.num_tokens].long().index_select(0, src)  # draft i is at pos + 2 + i
        rows = d.state_row[:S].long()
        qsl = torch.arange(S + 1, dtype=torch.int32, device=dev)
        drafts = torch.zeros(S, k, dtype=torch.int32, device=dev)
        # an all-greedy step drafts argmaxes and no q (its acceptance takes none: StepShape.greedy)
        sampled = None if shape.greedy else _draw_inputs(d, S, num_emitted)
        probs = None if shape.greedy else torch.zeros(S, k, self.vocab_size, dtype=torch.float32, device=dev)
        for i in range(k):
            if sampled is None:  # (the argmax over the drafter's vocabulary, one id mapped)
                tok = self.target_ids(logits.argmax(dim=-1)).to(torch.int32)
            else:
                greedy, scale, seed, token_index = sampled
                tok, probs[:, i] = sample_drafts(self.target_logits(logits).float() / scale, greedy, seed,
                                                 token_index + i)
            drafts[:, i] = tok
            if i == k - 1:
                break
            p = (pos + 2 + i - self.feed_offset).to(torch.int32)  # (int32, as the target's positions)
            logits, state = self.feed(tok.long(), p, state,
                                      self.meta(qsl, p + 1, rows, p, rows, 1, shape.max_seq_len + k + 1))
        self.drafts.index_copy_(0, rows, drafts)
        if probs is not None:
            self.probs.index_copy_(0, rows, probs)
        self.next_pos.index_copy_(0, rows, pos + 2)


def _draw_inputs(d, S: int, num_emitted: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A sampling step's per-row draw inputs: greedy [S], the temperature scale [S, 1] (1 for
    greedy rows), the seed and the output index of draft 0."""
    temperature = d.temperature[:S].float()
    greedy = temperature < GREEDY_EPS
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    return greedy, scale, d.seed[:S], d.token_index[:S].long() + num_emitted[:S].long()
