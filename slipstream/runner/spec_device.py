"""Device drafting: under asynchronous scheduling, batch N+1 is built before batch N's
accepted counts are known, so the GPU finishes N+1's inputs at the start of its step.

The scheduler lays a row out as if every step in flight emits one token; a row whose
previous step (N) verified drafts is `shift_src`-marked, and the GPU moves it by
delta = (N's emitted count for it) - 1 (0 for rows of N without drafts):

- positions and the row's sequence length += delta; the slot mapping is recomputed from
  the block table at the moved positions (the scheduler reserved KV for k more tokens);
- the sampling row's token index += delta (a draw at output index i always uses the noise
  of (seed, i), so the draws are those of the synchronous loop);
- the row's first input is N's last emitted token (the carry-over: the verification step
  leaves it in the slot's `tokens`);
- every input token is written into the device token history (`DeviceHistory`: one row of
  max_model_len tokens a request-table row) at its position, and each verifying row's k
  drafts come from `spec.ngram.propose_ngram_device` over its history up to its first
  input, then go into its input ids (and the history).  The history of a request is reset
  from the host's known tokens the first time it runs in such a step (admission, after
  preemption, after plain steps, which write none).

Nothing here waits for the host: N+1 is launched before N's counts are read back.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slipstream.ops.carry import carry_over


def to_device(a, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host array on `device` without blocking the host: on CUDA through pinned memory (a
    copy from pageable memory would first wait for the stream to drain)."""
    t = torch.as_tensor(a, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class DeviceHistory:
    """int32 [rows, max_model_len] token history on the device, made at first use."""

    def __init__(self, num_rows: int, max_model_len: int, device: torch.device) -> None:
        self.tokens = torch.zeros(num_rows, max_model_len, dtype=torch.int32, device=device)

    def reset(self, resets: list[tuple[int, list[int]]]) -> None:
        for row, tokens in resets:
            if tokens:
                self.tokens[row, :len(tokens)] = to_device(tokens, self.tokens.device, torch.int32)


@dataclass
class DeviceDraftInputs:
    """The host-known indices a device-drafting step needs, on the device."""
    shift_src: torch.Tensor  # int64 [B]
    token_seq: torch.Tensor  # int64 [T]: sequence row of each token
    table_rows: torch.Tensor  # int64 [B]: request-table row of each sequence row
    sample_seq: torch.Tensor  # int64 [S]
    first_token: torch.Tensor  # int64 [R]: each verifying row's first input token
    verify_table_rows: torch.Tensor  # int64 [R]
    verify_rows: torch.Tensor | None = None  # int64 [R]: each verifying row's sampling row
    packed: torch.Tensor | None = None  # the one uploaded buffer the fields are views of

    @classmethod
    def upload(cls, batch, host, rows: np.ndarray, device: torch.device) -> "DeviceDraftInputs":
        """`rows`: the verifying rows' sampling-row indices.  One pinned upload holds every
        field (each upload costs a pinned block, a copy and the host's Python a step)."""
        B, S = batch.num_seqs, len(batch.sampled)
        qsl = host.query_start_loc[:B + 1].astype(np.int64)
        token_seq = np.repeat(np.arange(B), np.diff(qsl))
        vseq = batch.sample_seq[rows].astype(np.int64)
        parts = [batch.spec.shift_src, token_seq, batch.rows, batch.sample_seq[:S], qsl[vseq], batch.rows[vseq], rows]
        packed = to_device(np.concatenate([np.asarray(a, np.int64) for a in parts]), device)
        return cls(*torch.split(packed, [len(a) for a in parts]), packed=packed)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What the compute stream must keep alive: the buffer the fields view."""
        if self.packed is not None:
            return (self.packed,)
        return tuple(t for t in (self.shift_src, self.token_seq, self.table_rows, self.sample_seq,
                                 self.first_token, self.verify_table_rows, self.verify_rows) if t is not None)


def history(runner) -> DeviceHistory:
    h = getattr(runner, "spec_history", None)
    if h is None:
        h = runner.spec_history = DeviceHistory(runner.opts.max_num_seqs + 1, runner.max_model_len, runner.device)
    return h


def triton_drafting(d) -> bool:
    """Whether the step's drafting takes the Triton kernels: on CUDA (a CPU test turns it on
    under Triton's interpreter)."""
    return d.positions.is_cuda


def prepare_device_drafts(runner, slot, shape, spec, inp: DeviceDraftInputs, prev_num_emitted: torch.Tensor,
                          into: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """On the compute stream, before the forward pass: shift the rows, carry the first
    tokens over, write the history, draft. Returns the verifying rows' drafts int32 [R, k]
    and their counts int32 [R] (also placed in the step's input ids, and with `into`, an
    int32 [rows, k + 2] buffer and the verifying rows' rows of it, in row into[1][r]: its
    drafts, then their count).  On CUDA: two Triton kernels (ops/triton_device_drafts.py), not
    the reference's fifty to a hundred small launches."""
    d = slot.dev
    h = history(runner)
    h.reset(spec.history_resets)
    prev_tokens = runner.slots[1 - slot.index].dev.tokens
    drafter = getattr(runner, "drafter", None)
    synthetic = spec.bench_synthetic_accept is not None
    if triton_drafting(d):
        from slipstream.ops.triton_device_drafts import shift_and_draft_triton
        return shift_and_draft_triton(d.positions, d.seq_lens, d.slot_mapping, d.block_table, d.input_ids,
                                      d.carry_idx, d.token_index, d.query_start_loc, prev_tokens, prev_num_emitted,
                                      h.tokens, inp.shift_src, inp.sample_seq, inp.table_rows, inp.first_token,
                                      inp.verify_table_rows, runner.block_size, spec.k, spec.min_n, spec.max_n,
                                      synthetic, into,
                                      None if drafter is None else (drafter.drafts, drafter.next_pos))
    drafts, num = shift_and_draft_ref(d, prev_tokens, h.tokens, inp, prev_num_emitted, shape.num_tokens,
                                      runner.block_size, spec.k, spec.min_n, spec.max_n, synthetic, drafter)
    if into is not None:
        dst, rows = into
        dst[:, :spec.k].index_copy_(0, rows, drafts.to(torch.int32))
        dst[:, spec.k].index_copy_(0, rows, num.to(torch.int32))
    return drafts, num


def shift_and_draft_ref(d, prev_tokens: torch.Tensor, hist: torch.Tensor, inp: DeviceDraftInputs,
                        prev_num_emitted: torch.Tensor, T: int, bs: int, k: int, min_n: int, max_n: int,
                        synthetic: bool = False, drafter=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of `prepare_device_drafts` in torch ops (the CPU's path, and a device
    drafter's): `d` the slot's device inputs (T real tokens), `hist` the token history
    int32 [rows, L], `drafter` a device drafter whose drafts are taken instead of n-gram ones."""
    B, S = inp.shift_src.shape[0], inp.sample_seq.shape[0]
    src = inp.shift_src
    delta = torch.where(src >= 0, prev_num_emitted.index_select(0, src.clamp(min=0)).long() - 1,
                        torch.zeros_like(src))
    pos = d.positions[:T]
    pos += delta.index_select(0, inp.token_seq).to(pos.dtype)
    d.seq_lens[:B] += delta.to(d.seq_lens.dtype)
    # a row whose step in flight ended its request at the context's end (this step's output
    # is dropped) may move past the context: it stays inside, every index below in bounds
    # (a live row never moves there: its next input is a known token)
    L = hist.shape[1]
    pos.clamp_(max=L - 1)
    d.seq_lens[:B].clamp_(max=L)
    d.token_index[:S] += delta.index_select(0, inp.sample_seq).to(d.token_index.dtype)
    p = pos.long()
    blocks = d.block_table[:B][inp.token_seq, p // bs].long()
    moved = blocks * bs + p % bs
    sm = d.slot_mapping[:T]
    sm.copy_(torch.where(sm >= 0, moved.to(sm.dtype), sm))
    input_ids = d.input_ids[:T]
    carry_over(input_ids, d.carry_idx[:T], prev_tokens)
    hist[inp.table_rows.index_select(0, inp.token_seq), p] = input_ids
    first = inp.first_token
    p0 = p.index_select(0, first)
    if drafter is not None:  # drafted at the end of the previous step (runner/device_drafter.py)
        drafts, num = drafter.device_drafts(inp.verify_table_rows, p0 + 1)
    else:
        drafts, num = _propose(hist.index_select(0, inp.verify_table_rows), (p0 + 1).to(torch.int32), k,
                               min_n, max_n)
    if synthetic:  # (bench only) k drafts a row: the first input repeated
        cols = torch.arange(k, device=first.device)[None, :]
        drafts = torch.where(cols < num[:, None], drafts, input_ids.index_select(0, first)[:, None].to(drafts.dtype))
        num = torch.full_like(num, k)
    offsets = torch.arange(1, k + 1, device=first.device)[None, :]
    input_ids[(first[:, None] + offsets).reshape(-1)] = drafts.reshape(-1).to(input_ids.dtype)
    hist[inp.verify_table_rows[:, None].expand(-1, k), p0[:, None] + offsets] = drafts
    return drafts, num


def _propose(history_rows: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int, max_n: int):
    from slipstream.spec.ngram import propose_ngram_device
    if history_rows.shape[0] == 0:
        z = torch.zeros(0, k, dtype=torch.int32, device=history_rows.device)
        return z, torch.zeros(0, dtype=torch.int32, device=history_rows.device)
    return propose_ngram_device(history_rows, lengths, k, min_n, max_n)
