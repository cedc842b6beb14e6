"""Device drafting's input correction and n-gram drafts in two Triton kernels (CUDA; imported
only when it runs, so the CPU engine needs no Triton).

The torch version (`runner/spec_device.py`, `shift_and_draft_ref`, the reference) takes
about a hundred small ops a step, each a kernel launch and a few microseconds of the host's
Python: at batch 1 on a small model that is most of a speculative step.  Here:

- `_shift_kernel`, a program per sequence row (and per sampling row): the row's shift by the
  previous step's emitted count - 1 (positions, sequence length, slot mapping from the
  block table; the sampling row's token index), the carry-over of its first input, and its
  input tokens into the device token history at their positions;
- `_ngram_kernel`, a program per verifying row: the prompt-lookup rule of
  `spec.ngram.propose_ngram_device` over the row's history up to its first input (the
  longest n-gram suffix that occurs before, its earliest occurrence), in one pass over
  the history in blocks, or a device drafter's buffered drafts for the row (k when they
  were made for its position, else none); the k drafts (0 past the found ones) into the
  row's input ids after its first input, into the history after it, and out.

The second kernel reads what the first wrote (the first input at its position): they run
in this order on one stream.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.ops.pdl import pdl_launch, pdl_start


@triton.jit
def _delta(shift_ptr, emitted_ptr, row):
    """The shift of sequence row `row`: its shift source's emitted count - 1, or 0."""
    src = tl.load(shift_ptr + row)
    n = tl.load(emitted_ptr + tl.maximum(src, 0))
    return tl.where(src >= 0, n - 1, 0)


@triton.jit(do_not_specialize=["B", "S"])
def _shift_kernel(pos_ptr, seq_lens_ptr, slot_map_ptr, block_table_ptr, bt_stride, ids_ptr, carry_ptr,
                  token_index_ptr, qsl_ptr, prev_tokens_ptr, emitted_ptr, hist_ptr, hist_stride,
                  shift_ptr, sample_seq_ptr, table_rows_ptr, B, S, L, block_size,
                  BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    row = tl.program_id(0)
    if row < S:  # the sampling row's token index (a draw at output index i uses the noise of i)
        seq = tl.load(sample_seq_ptr + row)
        ti = tl.load(token_index_ptr + row)
        tl.store(token_index_ptr + row, ti + _delta(shift_ptr, emitted_ptr, seq))
    if row < B:
        delta = _delta(shift_ptr, emitted_ptr, row)
        # a row whose request ended at the context's end in the step before may move past it:
        # it stays inside, every index in bounds (its output is dropped)
        sl = tl.load(seq_lens_ptr + row)
        tl.store(seq_lens_ptr + row, tl.minimum(sl + delta, L))
        start = tl.load(qsl_ptr + row)
        end = tl.load(qsl_ptr + row + 1)
        hist_row = hist_ptr + tl.load(table_rows_ptr + row).to(tl.int64) * hist_stride
        for off in range(start, end, BLOCK):
            t = off + tl.arange(0, BLOCK)
            inside = t < end
            p = tl.minimum(tl.load(pos_ptr + t, mask=inside, other=0) + delta, L - 1)
            tl.store(pos_ptr + t, p, mask=inside)
            sm = tl.load(slot_map_ptr + t, mask=inside, other=-1)
            block = tl.load(block_table_ptr + row * bt_stride + p // block_size, mask=inside & (sm >= 0), other=0)
            tl.store(slot_map_ptr + t, block * block_size + p % block_size, mask=inside & (sm >= 0))
            src = tl.load(carry_ptr + t, mask=inside, other=-1)
            token = tl.load(ids_ptr + t, mask=inside, other=0)
            token = tl.where(src >= 0, tl.load(prev_tokens_ptr + tl.maximum(src, 0), mask=inside, other=0), token)
            tl.store(ids_ptr + t, token, mask=inside)
            tl.store(hist_row + p, token, mask=inside)


@triton.jit(do_not_specialize=["L"])
def _ngram_kernel(pos_ptr, ids_ptr, hist_ptr, hist_stride, first_ptr, vrows_ptr, drafts_ptr, num_ptr, L,
                  dst_ptr, dst_stride, dst_rows_ptr, buf_drafts_ptr, buf_next_pos_ptr,
                  K: tl.constexpr, KP: tl.constexpr, MIN_N: tl.constexpr, MAX_N: tl.constexpr,
                  SYNTHETIC: tl.constexpr, HAS_DST: tl.constexpr, BUFFERED: tl.constexpr, BLOCK: tl.constexpr,
                  USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    r = tl.program_id(0)
    first = tl.load(first_ptr + r)
    last = tl.load(pos_ptr + first)  # the row's first input: the last token of its history
    vrow = tl.load(vrows_ptr + r).to(tl.int64)
    hist_row = hist_ptr + vrow * hist_stride
    j = tl.arange(0, KP)
    if BUFFERED:  # a device drafter's drafts, made for this position or not (then none count)
        num = tl.where(tl.load(buf_next_pos_ptr + vrow) == last + 1, K, 0)
        drafts = tl.load(buf_drafts_ptr + vrow * K + j, mask=j < K, other=0)
    else:
        best = 0
        best_end = 0
        for off in range(0, last, BLOCK):
            e = off + tl.arange(0, BLOCK)
            valid = e < last  # an occurrence ends before the last token
            run = valid
            match = tl.zeros([BLOCK], dtype=tl.int32)
            for i in tl.static_range(MAX_N):  # tokens e - i against the suffix's last - i
                target = tl.load(hist_row + tl.maximum(last - i, 0))
                h = tl.load(hist_row + e - i, mask=valid & (e >= i), other=0)
                run = run & (h == target) & (e >= i) & (last >= i)
                match += run.to(tl.int32)
            top = tl.max(match, axis=0)
            at = tl.min(tl.where(valid & (match == top), e, 2147483647), axis=0)
            better = top > best  # the earliest end of the longest n-gram: an equal later one loses
            best_end = tl.where(better, at, best_end)
            best = tl.where(better, top, best)
        num = tl.where(best >= MIN_N, tl.minimum(last - best_end, K), 0)
        drafts = tl.load(hist_row + tl.minimum(best_end + 1 + j, L - 1), mask=j < num, other=0)
    if SYNTHETIC:  # (bench only) k drafts a row: the first input repeated past the found ones
        drafts = tl.where(j < num, drafts, tl.load(ids_ptr + first))
        num = num * 0 + K
    put = j < K
    tl.store(drafts_ptr + r * K + j, drafts, mask=put)
    tl.store(num_ptr + r, num)
    tl.store(ids_ptr + first + 1 + j, drafts, mask=put)
    tl.store(hist_row + last + 1 + j, drafts, mask=put & (last + 1 + j < L))
    if HAS_DST:  # the padded step's static verify inputs: the row's drafts, then their count
        dst_row = dst_ptr + tl.load(dst_rows_ptr + r) * dst_stride
        tl.store(dst_row + j, drafts, mask=put)
        tl.store(dst_row + K, num)


def shift_and_draft_triton(positions: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
                           block_table: torch.Tensor, input_ids: torch.Tensor, carry_idx: torch.Tensor,
                           token_index: torch.Tensor, query_start_loc: torch.Tensor, prev_tokens: torch.Tensor,
                           prev_num_emitted: torch.Tensor, history: torch.Tensor, shift_src: torch.Tensor,
                           sample_seq: torch.Tensor, table_rows: torch.Tensor, first_token: torch.Tensor,
                           verify_table_rows: torch.Tensor, block_size: int, k: int, min_n: int, max_n: int,
                           synthetic: bool = False, into: tuple[torch.Tensor, torch.Tensor] | None = None,
                           buffered: tuple[torch.Tensor, torch.Tensor] | None = None,
                           block: int = 64, ngram_block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on the step's int32 device inputs (B sequence rows: `shift_src`, `table_rows`;
    S sampling rows: `sample_seq`; R verifying rows: `first_token`, `verify_table_rows`) and
    the int32 [rows, L] `history`, as `shift_and_draft_ref`; returns the verifying rows'
    drafts int32 [R, k] and counts int32 [R].  `into` (int32 [rows, >= k + 1], int64 [R]):
    row into[1][r] of into[0] also gets verifying row r's drafts, then its count (the padded
    step's static verify inputs).  `buffered` (int32 [rows, k], int64 [rows]: a device
    drafter's drafts and the position each row's were made for, runner/device_drafter.py):
    the verifying rows take those instead of n-gram ones.  `block`, `ngram_block`: the tokens a loop
    iteration takes (tests make them small, so that rows and histories span several)."""
    B, S, R = shift_src.shape[0], sample_seq.shape[0], first_token.shape[0]
    L = history.shape[1]
    dev = positions.device
    drafts = torch.empty(R, k, dtype=torch.int32, device=dev)
    num = torch.empty(R, dtype=torch.int32, device=dev)
    pdl = pdl_launch(dev)
    if max(B, S):
        _shift_kernel[(max(B, S),)](positions, seq_lens, slot_mapping, block_table, block_table.stride(0),
                                    input_ids, carry_idx, token_index, query_start_loc, prev_tokens,
                                    prev_num_emitted, history, history.stride(0), shift_src, sample_seq,
                                    table_rows, B, S, L, block_size, BLOCK=block, **pdl)
    if R:
        dst, dst_rows = into if into is not None else (num, first_token)  # (unused without `into`)
        buf_drafts, buf_next_pos = buffered if buffered is not None else (num, first_token)  # (likewise)
        assert buffered is None or buf_drafts.is_contiguous() and buf_drafts.shape[1] == k
        _ngram_kernel[(R,)](positions, input_ids, history, history.stride(0), first_token, verify_table_rows,
                            drafts, num, L, dst, dst.stride(0), dst_rows, buf_drafts, buf_next_pos,
                            K=k, KP=triton.next_power_of_2(k), MIN_N=min_n, MAX_N=max_n, SYNTHETIC=synthetic,
                            HAS_DST=into is not None, BUFFERED=buffered is not None, BLOCK=ngram_block, **pdl)
    return drafts, num
