"""Turn a scheduled batch into a slot's host inputs, with numpy gathers over rows.

No Python loop runs over the requests of a batch: every per-token and per-row field is
gathered from the request table (slipstream.sched.request_table) by row index.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slipstream.sampling.sampler import GREEDY_EPS, SamplerFlags
from slipstream.sampling.columns import SAMPLING_COLUMNS
from slipstream.sched.batch import ScheduledBatch


@dataclass(frozen=True)
class StepShape:
    """Host-side sizes of a step; a CUDA graph is keyed by them (runner/graphs.py)."""
    num_tokens: int  # padded
    num_seqs: int  # padded
    num_samples: int  # padded
    max_query_len: int
    max_seq_len: int
    flags: SamplerFlags
    padded: bool  # padded to the sizes of a captured graph
    num_decode: int = 0  # a mixed batch's single-token rows, listed first in decode_order
    decode_splits: int | None = None  # decode attention's split count (None: its heuristic)
    # a verification step (speculative decoding): k + 1, each row's most query tokens, for the
    # attention's verify kernel (runner/verify_graphs.py); 0: not one
    verify_len: int = 0
    # every sampling row draws greedily: speculative acceptance needs no draft probabilities
    # (a greedy row accepts a draft iff it is the target's argmax), so drafters skip them
    greedy: bool = False

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1

    @property
    def samples_every_token(self) -> bool:
        """Token i is sample i for every i: the logits need no gather."""
        return self.is_decode and self.num_samples == self.num_tokens

    @classmethod
    def padded_to(cls, pad: "StepPad", decode: bool, flags: SamplerFlags, max_seq_len: int,
                  decode_splits: int | None = None, greedy: bool = False) -> "StepShape":
        """The shape of a batch padded to `pad`, as its CUDA graph is captured and looked up:
        a decode batch has one token and one sample per row; a mixed batch samples every
        row, and its decode kernel covers every row (num_decode)."""
        P, PT = pad.num_seqs, pad.num_tokens
        if decode:
            return cls(P, P, P, 1, max_seq_len, flags, padded=True, decode_splits=decode_splits, greedy=greedy)
        return cls(PT, P, P, PT, max_seq_len, flags, padded=True, num_decode=P, greedy=greedy)


@dataclass(frozen=True)
class StepPad:
    """The sizes a batch is padded to for a CUDA graph: a decode batch to `num_seqs` rows of
    one token each (num_tokens == num_seqs), a mixed batch to `num_tokens` tokens and
    `num_seqs` rows (padding rows own no token)."""
    num_tokens: int
    num_seqs: int


def fill_inputs(batch: ScheduledBatch, host, block_size: int, pad: StepPad | None,
                graph_max_seq_len: int, verify: bool = False) -> StepShape:
    """The batch's inputs into the slot's host side, padded to `pad` (None: unpadded); its
    shape.  `verify`: padded in the verify layout (runner/verify_graphs.py) even when every
    row has one token (a device drafter's step without draft slots), not the decode one."""
    t = batch.table
    rows, start, n = batch.rows, batch.start, batch.num_new
    B = len(rows)
    qsl = np.zeros(B + 1, np.int64)
    np.cumsum(n, out=qsl[1:])
    T = int(qsl[-1])
    seq_of_token = np.repeat(np.arange(B), n)
    pos = np.arange(T) - qsl[seq_of_token] + start[seq_of_token]
    row_of_token = rows[seq_of_token]
    host.input_ids[:T] = t.token_ids[row_of_token, pos]
    host.positions[:T] = pos
    host.slot_mapping[:T] = t.block_table[row_of_token, pos // block_size] * block_size + pos % block_size
    host.carry_idx[:T] = -1
    carried = batch.carry_src >= 0
    host.carry_idx[qsl[:-1][carried]] = batch.carry_src[carried]
    host.query_start_loc[:B + 1] = qsl
    host.seq_lens[:B] = start + n
    num_blocks = -(-batch.max_seq_len // block_size)
    host.block_table[:B, :num_blocks] = t.block_table[rows, :num_blocks]

    S = len(batch.sampled)
    sample_rows = rows[batch.sample_seq]
    host.logits_indices[:S] = qsl[batch.sample_seq + 1] - 1
    host.token_index[:S] = batch.token_index
    host.state_row[:S] = sample_rows
    for c in SAMPLING_COLUMNS:
        getattr(host, c.name)[:S] = t.columns[c.name][sample_rows]
    temperature, top_k, top_p = host.temperature[:S], host.top_k[:S], host.top_p[:S]
    rep, pres, freq = host.repetition_penalty[:S], host.presence_penalty[:S], host.frequency_penalty[:S]
    sampling = temperature > 0
    flags = SamplerFlags(
        use_top_k_top_p=bool(((top_k[sampling] > 0) | (top_p[sampling] < 1.0)).any()),
        use_penalties=bool(((rep != 1.0) | (pres != 0.0) | (freq != 0.0)).any()),
        num_logprobs=batch.num_logprobs)
    greedy = not bool((temperature >= GREEDY_EPS).any())

    max_query_len = int(n.max())
    if pad is None:
        num_decode = 0
        if max_query_len == 1:
            _decode_order(host, B)
        else:
            num_decode = _single_token_rows(host, n, B)
        sampling_scalars(host, S)
        return StepShape(T, B, S, max_query_len, batch.max_seq_len, flags, padded=False,
                         num_decode=num_decode, greedy=greedy)
    P, PT = pad.num_seqs, pad.num_tokens
    decode = max_query_len == 1 and not verify
    assert B <= P and T <= PT and (not decode or PT == P), (B, T, pad)
    pad_batch(host, T, B, S, pad, decode, t.scratch_row)
    if decode:
        _decode_order(host, P)
    else:
        # the graph's decode kernel takes every row in decode_order and skips those that do
        # not have exactly one query token (the prefill kernel's rows and the padding)
        _single_token_rows(host, np.concatenate([n, np.zeros(P - B, n.dtype)]), P)
    return StepShape.padded_to(pad, decode, flags, graph_max_seq_len, greedy=greedy)


def pad_batch(host, num_tokens: int, num_seqs: int, num_samples: int, pad: StepPad, decode: bool,
              scratch_row: int) -> None:
    """Fill a slot's host inputs from a batch's real sizes up to `pad`'s.  Padding tokens
    store nothing; padding rows have no context (seq_len 0) and draw greedily into the
    scratch row.  A decode batch's padding rows own one token each (tokens, rows and
    samples stay one to one); a mixed batch's own none."""
    T, B, S = num_tokens, num_seqs, num_samples
    P, PT = pad.num_seqs, pad.num_tokens
    host.input_ids[T:PT] = 0
    host.positions[T:PT] = 0
    host.slot_mapping[T:PT] = -1
    host.carry_idx[T:PT] = -1
    host.query_start_loc[B + 1:P + 1] = np.arange(T + 1, T + 1 + P - B) if decode else T
    host.seq_lens[B:P] = 0
    host.logits_indices[S:P] = np.arange(S, P) if decode else 0
    host.token_index[S:P] = 0
    host.state_row[S:P] = scratch_row
    for c in SAMPLING_COLUMNS:
        getattr(host, c.name)[S:P] = c.neutral
    sampling_scalars(host, P)


def sampling_scalars(host, num_samples: int) -> None:
    """The sampler's inv_t and log(min_p) from temperature and min_p, on the host: a few
    device launches less per step.  float32 division is correctly rounded everywhere, so
    inv_t has the bits the sampler's torch fallback would compute."""
    temp = host.temperature[:num_samples]
    host.inv_t[:num_samples] = np.float32(1.0) / np.where(temp < GREEDY_EPS, np.float32(1.0), temp)
    with np.errstate(divide="ignore"):  # log(0) = -inf: min-p off
        host.log_min_p[:num_samples] = np.log(host.min_p[:num_samples])


def _single_token_rows(host, num_new, num_rows: int) -> int:
    """A mixed batch: its rows with one new token, longest context first, at the head of
    decode_order (the decode kernel's rows), the other rows after them; returns how many
    rows have one token."""
    single = num_new == 1
    idx = np.flatnonzero(single)
    order = np.argsort(-host.seq_lens[idx], kind="stable")
    host.decode_order[:len(idx)] = idx[order]
    host.decode_order[len(idx):num_rows] = np.flatnonzero(~single)
    return len(idx)


def _decode_order(host, num_seqs: int) -> None:
    """Rows by decreasing context for the decode attention kernel (longest first, so the
    long rows do not finish last); padding rows (seq_len 0) come at the end."""
    host.decode_order[:num_seqs] = np.argsort(-host.seq_lens[:num_seqs], kind="stable")
