"""The `eagle3` drafter: an EAGLE-3 head (model/eagle3.py) drafts k tokens a row on the device
at the end of every step, from the target's hidden states of that step, so the next step's
drafts are already on the GPU when it starts (sync and async loops alike).

At the end of a step (after sampling and verification), on the compute stream:

1. extend: the head runs over every token of the step.  Token t at position p reads the
   target's three captured hidden states at t (`AuxHiddenCapture` around the target's eager
   forward) and the embedding of the token that follows it: the next input of its row, or,
   at a sampling row's query tokens, the tokens the row emitted (out[j] follows query token
   j; past the accepted ones this is padding), or, at the end of a prefill chunk, the next
   prompt token.  Its KV goes into the head's cache at p.
2. draft: from each sampling row's last accepted token (query token num_emitted - 1), the
   head drafts autoregressively: draft i is drawn from the head's distribution over the
   target vocabulary (temperature-scaled; greedy rows take the argmax) with the drafter's own
   noise (`spec.draft.sample_drafts`), then fed back with the head's pre-norm output as the
   next hidden state, one decode-shaped head step per draft, all rows batched.
3. the drafts, their q (float32 [k, V]) and the position of the first draft go into per
   request-table-row buffers.  A step verifies a row's buffered drafts only when that
   position is its first draft slot's (`next_pos`): a row whose previous step did not run
   the head (a disabled step, a prefix-cache hit) drafts nothing that step.

The head's KV cache is private and row-contiguous (row r of the request table owns blocks
[r * B, (r + 1) * B), B = ceil(max_model_len / block_size)), as the draft model's
(runner/draft_model.py): the block table is a function of the row, so the head needs no
block pool or eviction and runs the engine's paged attention kernels unchanged; it costs
rows x max_model_len x 2 x kv_size of the head's one layer (small beside the target's).  The
entries the head writes past a row's accepted tokens (rejected positions, the autoregressive
drafts) are rewritten by the next step's extend before any query reads them, since a step's
extend starts at the row's first unverified position.  A preempted request recomputes its
tokens through the target, so the extend rebuilds its head KV too.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slipstream.model.eagle3 import AuxHiddenCapture
from slipstream.model.eagle3_loader import load_eagle3
from slipstream.ops.metadata import AttentionMetadata
from slipstream.runner.kv_memory import KVCacheSpec, allocate_kv_caches
from slipstream.runner.spec_device import to_device
from slipstream.sampling.sampler import GREEDY_EPS
from slipstream.spec.draft import sample_drafts


@dataclass
class EagleStepInputs:
    """Host-known indices of one step, uploaded with its inputs."""
    first: torch.Tensor  # int64 [S]: each sampling row's first query token
    num_slots: torch.Tensor  # int64 [S]: its draft slots (query tokens past the first)
    token_seq: torch.Tensor  # int64 [T]: sequence row of each token
    seq_rows: torch.Tensor  # int64 [B]: request-table row of each sequence row
    prompt_at: torch.Tensor  # int64 [P]: the last token of each non-sampling row
    prompt_next: torch.Tensor  # int64 [P]: the prompt token after it

    @classmethod
    def upload(cls, batch, host, num_slots: np.ndarray, device: torch.device) -> EagleStepInputs:
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

        return cls(dev(first), dev(num_slots), dev(np.repeat(np.arange(B), np.diff(qsl))), dev(batch.rows),
                   dev(last[seqs]), dev(np.maximum(nxt, 0)))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.first, self.num_slots, self.token_seq, self.seq_rows, self.prompt_at, self.prompt_next)


class Eagle3Drafter:
    """Loads the head and drafts for every sampling row of each step (module doc)."""

    def __init__(self, source: str, target, target_config, num_rows: int, max_model_len: int,
                 block_size: int, device: torch.device, dtype: torch.dtype, k: int) -> None:
        fmt = "dummy" if str(source).endswith(".json") else "auto"
        self.head = load_eagle3(source, fmt, dtype, device)
        c = self.head.config
        if c.vocab_size != target_config.vocab_size:
            raise ValueError(f"speculative_config.model: the EAGLE-3 head's vocab_size is {c.vocab_size}, "
                             f"the target's {target_config.vocab_size}")
        if c.target_hidden_size != target_config.hidden_size:
            raise ValueError(f"speculative_config.model: the EAGLE-3 head reads target hidden states of "
                             f"size {c.target_hidden_size}, the target's are {target_config.hidden_size}")
        if c.layer.max_position_embeddings < max_model_len + k:
            raise ValueError(f"speculative_config.model: the EAGLE-3 head's max_position_embeddings "
                             f"({c.layer.max_position_embeddings}) is below max_model_len + k ({max_model_len + k})")
        if self.head.embed_tokens is None:
            self.head.share_embedding(target.embed_tokens.weight)
        self.aux_layers = c.aux_layers(len(target.layers))
        self.target = target
        self.device, self.k, self.block_size = device, k, block_size
        self.vocab_size = c.vocab_size
        self.blocks_per_row = -(-(max_model_len + k) // block_size)
        lc = c.layer
        spec = KVCacheSpec(1, block_size, lc.num_kv_heads, lc.head_dim, dtype)
        self.kv_cache = allocate_kv_caches(spec, num_rows * self.blocks_per_row, device)[0]
        # per request-table row: the drafts made at the end of its last step, their q, and
        # the position of the first draft (-1: none)
        self.drafts = torch.zeros(num_rows, k, dtype=torch.int32, device=device)
        self.probs = torch.zeros(num_rows, k, c.vocab_size, dtype=torch.float32, device=device)
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
    def capture(self) -> AuxHiddenCapture:
        return AuxHiddenCapture(self.target, self.aux_layers)

    def device_drafts(self, table_rows: torch.Tensor, first_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Asynchronous loop: the buffered drafts int32 [R, k] and their counts int32 [R] (k
        when they were made for draft position `first_pos`, else 0); their q is
        `probs.index_select(0, table_rows)`."""
        valid = self.next_pos.index_select(0, table_rows) == first_pos.long()
        num = torch.where(valid, self.k, 0).to(torch.int32)
        return self.drafts.index_select(0, table_rows), num

    def _meta(self, qsl, seq_lens, table_rows, positions, token_rows, max_query_len, max_seq_len):
        bs = self.block_size
        table = (table_rows.long()[:, None] * self.blocks_per_row
                 + torch.arange(self.blocks_per_row, device=self.device)[None, :]).to(torch.int32)
        p = positions.long()
        slots = (token_rows.long() * self.blocks_per_row + p // bs) * bs + p % bs
        return AttentionMetadata(qsl.to(torch.int32), seq_lens.to(torch.int32), table, slots.to(torch.int32),
                                 max_query_len, max_seq_len)

    @torch.inference_mode()
    def after_step(self, slot, shape, out: torch.Tensor, num_emitted: torch.Tensor, inp: EagleStepInputs,
                   aux: torch.Tensor) -> None:
        """Extend the head over the step's tokens and draft k tokens for each sampling row
        (module doc).  `out` int32 [S, k + 1] / `num_emitted` int32 [S]: the rows' emitted
        tokens; `aux` [T, 3 H_target]: the target's captured hidden states."""
        self._host = None
        d = slot.dev
        T, B, S, k = shape.num_tokens, shape.num_seqs, shape.num_samples, self.k
        dev = self.device
        ids = d.input_ids[:T].long()
        positions = d.positions[:T].long()
        nxt = torch.zeros(T + 1, dtype=torch.long, device=dev)  # (index T: a scratch entry)
        nxt[:T - 1] = ids[1:]
        nxt[inp.prompt_at] = inp.prompt_next
        K1 = out.shape[1]
        j = torch.arange(K1, device=dev)[None, :]
        at = torch.where(j <= inp.num_slots[:, None], inp.first[:, None] + j, T)
        nxt[at.reshape(-1)] = out.long().clamp(min=0).reshape(-1)
        head = self.head
        token_rows = inp.seq_rows.index_select(0, inp.token_seq)
        meta = self._meta(d.query_start_loc[:B + 1], d.seq_lens[:B], inp.seq_rows, positions, token_rows,
                          shape.max_query_len, shape.max_seq_len)
        normed, pre = head(nxt[:T], positions, head.combine_hidden_states(aux), meta, self.kv_cache)
        src = inp.first + num_emitted[:S].long() - 1
        hidden, normed = pre.index_select(0, src), normed.index_select(0, src)
        pos = positions.index_select(0, src)
        rows = d.state_row[:S].long()
        temperature = d.temperature[:S].float()
        greedy = temperature < GREEDY_EPS
        scale = torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
        seed = d.seed[:S]
        token_index = d.token_index[:S].long() + num_emitted[:S].long()
        qsl = torch.arange(S + 1, dtype=torch.int32, device=dev)
        drafts = torch.zeros(S, k, dtype=torch.int32, device=dev)
        probs = torch.zeros(S, k, self.vocab_size, dtype=torch.float32, device=dev)
        for i in range(k):
            logits = head.target_logits(normed).float() / scale
            tok, q = sample_drafts(logits, greedy, seed, token_index + i)
            drafts[:, i] = tok
            probs[:, i] = q
            if i == k - 1:
                break
            p = pos + 1 + i
            meta = self._meta(qsl, p + 1, rows, p, rows, 1, shape.max_seq_len + k)
            normed, hidden = head(tok.long(), p, hidden, meta, self.kv_cache)
        self.drafts.index_copy_(0, rows, drafts)
        self.probs.index_copy_(0, rows, probs)
        self.next_pos.index_copy_(0, rows, pos + 2)
