"""The split-KV decode kernel for speculative verification: each row has up to Q_LEN query
tokens (its last token and its drafts), the newest Q_LEN positions of its context.

It is the decode kernel's design (`triton_attention_kernels._decode_kernel`: one flat grid
of rows x KV heads x splits, rows longest first, the last split to finish merges) with the
GQA tile widened: a program's M dimension is (query position, head of the KV head's group),
BLOCK_M >= Q_LEN x GROUP rows, so the Q_LEN x GROUP queries that read one KV head share each
K/V tile load, and a step of k + 1 tokens a row reads its context once, as a plain decode
step does.  It is a kernel of its own so that the plain decode kernel compiles as it did.

Query i of a row with n query tokens (n = its query_start_loc span, 1 <= n <= Q_LEN; a row
of a verify batch with fewer drafts has fewer tokens, and a graph's fixed layout pads with
tokens whose outputs are never read) sits at position seq_len - n + i and sees the keys up
to it: the tiles every query sees entirely run unmasked, the last ones (the row's newest n
positions) with the causal mask.  With a sliding window W, query i sees (pos - W, pos], so
the row's keys start W + n - 1 before its end; every tile is masked then.

A split whose keys all lie past some query's position leaves that query's partial at zero
with a log-sum-exp of -inf, which the merge weighs by zero (every query sees its own
position, so one split of each has weight).
"""
from __future__ import annotations

import triton
import triton.language as tl

from slipstream.ops.pdl import pdl_start
from slipstream.ops.triton_attention_tiles import (attend_tile, chunk_len, decode_row, fp8_dot_q, lse_merge, row_start,
                                                   zero_tail)


@triton.jit
def _verify_split_range(seq_len, n_q, split, num_splits, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr,
                        WINDOW: tl.constexpr):
    """A verifying row's keys are [seq_len - span, seq_len) (span = seq_len, or with a
    WINDOW those its oldest query sees): its split length, this split's first key, the span."""
    if WINDOW > 0:
        span = tl.minimum(seq_len, WINDOW + n_q - 1)
    else:
        span = seq_len
    chunk = chunk_len(span, num_splits, BLOCK_N, MIN_CHUNK)
    return chunk, seq_len - span + split * chunk, span


@triton.jit
def _query_rows(q_tok, n_q, head0, GROUP: tl.constexpr, Q_LEN: tl.constexpr, BLOCK_M: tl.constexpr):
    """The tile's rows: row m is query token q_tok + m // GROUP, head head0 + m % GROUP;
    the mask of the rows that exist (m // GROUP < n_q)."""
    offs_m = tl.arange(0, BLOCK_M)
    qi = offs_m // GROUP
    head = head0 + offs_m % GROUP
    mmask = (qi < n_q) & (qi < Q_LEN)
    return qi, (q_tok + qi).to(tl.int64), head, mmask


@triton.jit
def _verify_merge(out_ptr, part_out_ptr, part_lse_ptr, tok, head, mmask, n_valid, stride_ot, stride_oh,
                  stride_pot, stride_poh, stride_pok, stride_plt, stride_plh,
                  BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """`lse_merge` of the rows' `n_valid` split partials into the output."""
    offs_d = tl.arange(0, HEAD_DIM)
    po = part_out_ptr + tok[:, None] * stride_pot + head[:, None] * stride_poh + offs_d[None, :]
    pl = part_lse_ptr + tok * stride_plt + head * stride_plh
    o = lse_merge(po, pl, mmask, n_valid, stride_pok, BLOCK_M, HEAD_DIM, float("-inf"))
    optrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(optrs, o.to(out_ptr.dtype.element_ty), mask=mmask[:, None])


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_splits"])  # no recompiles per step
def _verify_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                   qsl_ptr, seq_lens_ptr, bt_ptr, order_ptr, counter_ptr, qk_scale, num_seqs,
                   num_tokens, num_splits, stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                   stride_bt, stride_pot, stride_poh, stride_pok, stride_plt, stride_plh,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, Q_LEN: tl.constexpr, BLOCK_M: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   MIN_CHUNK: tl.constexpr, SPLIT: tl.constexpr, HAS_ORDER: tl.constexpr,
                   MERGE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, IEEE: tl.constexpr,
                   UPCAST: tl.constexpr, USE_PDL: tl.constexpr, WINDOW: tl.constexpr = 0,
                   v_scale=None, KV_FP8: tl.constexpr = False):
    pdl_start(USE_PDL)
    prog = tl.program_id(0)  # (row, KV head, split), the split fastest: as the decode kernel
    split = prog % num_splits
    kvh = (prog // num_splits) % NUM_KV_HEADS
    pid = prog // (num_splits * NUM_KV_HEADS)
    head0 = kvh * GROUP
    if pid == 0:
        if split == 0:
            zero_tail(out_ptr, qsl_ptr, num_seqs, num_tokens, head0, stride_ot, stride_oh,
                       GROUP, BLOCK_G, HEAD_DIM)
    seq, q_tok, q_end = decode_row(order_ptr, qsl_ptr, pid, HAS_ORDER)
    n_q = q_end - q_tok
    if n_q <= 0:
        return  # no query token in this row
    seq_len = tl.load(seq_lens_ptr + seq)
    chunk, start, span = _verify_split_range(seq_len, n_q, split, num_splits, BLOCK_N, MIN_CHUNK, WINDOW)
    qi, tok, head, mmask = _query_rows(q_tok, n_q, head0, GROUP, Q_LEN, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    if SPLIT:
        if start >= seq_len:
            if MERGE:  # no reduce pass: a context-free row's output is written here
                if (seq_len == 0) & (split == 0):
                    optrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
                    tl.store(optrs, tl.zeros([BLOCK_M, HEAD_DIM], dtype=out_ptr.dtype.element_ty),
                             mask=mmask[:, None])
            return  # past the end (the merge ignores this split)
    end = tl.minimum(start + chunk, seq_len)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=mmask[:, None], other=0.0)
    if KV_FP8:
        q = fp8_dot_q(q)
    acc, l_i, m_i, bt_row, k_head_off, v_head_off = row_start(bt_ptr, seq, stride_bt, kvh, stride_kch,
                                                               stride_vch, BLOCK_M, HEAD_DIM)
    row_pos = seq_len - n_q + qi
    # unmasked: whole tiles of keys every query sees (below the oldest query's position + 1)
    if WINDOW > 0:
        full_end = start
    else:
        seen = tl.maximum(tl.minimum(end, seq_len - n_q + 1) - start, 0)
        full_end = start + (seen // BLOCK_N) * BLOCK_N
    for t in range(start, full_end, BLOCK_N):
        acc, l_i, m_i = attend_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row,
                                     k_head_off, v_head_off, t, end, row_pos, qk_scale,
                                     stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                                     BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, False, IEEE, UPCAST,
                                     KV_FP8=KV_FP8)
    for t in range(full_end, end, BLOCK_N):
        acc, l_i, m_i = attend_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row,
                                     k_head_off, v_head_off, t, end, row_pos, qk_scale,
                                     stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                                     BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, True, IEEE, UPCAST,
                                     kv_lo=seq_len - span, WINDOW=WINDOW, KV_FP8=KV_FP8)
    if KV_FP8:  # (the split partials too: their merge is linear in them)
        acc = acc * v_scale
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # a query that sees no key of this split: 0
    if SPLIT:
        po = (part_out_ptr + tok[:, None] * stride_pot + head[:, None] * stride_poh + split * stride_pok
              + offs_d[None, :])
        tl.store(po, acc / l_safe[:, None], mask=mmask[:, None])
        pl = part_lse_ptr + tok * stride_plt + head * stride_plh + split
        tl.store(pl, tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf")), mask=mmask)
        if MERGE:
            # the last split of (row, KV head) to finish merges them all; it resets the counter
            tl.debug_barrier()
            cnt = counter_ptr + seq * NUM_KV_HEADS + kvh
            done = tl.atomic_add(cnt, 1, sem="acq_rel")
            n_valid = tl.cdiv(span, chunk)
            if done == n_valid - 1:
                tl.atomic_xchg(cnt, 0)
                _verify_merge(out_ptr, part_out_ptr, part_lse_ptr, tok, head, mmask, n_valid, stride_ot,
                              stride_oh, stride_pot, stride_poh, stride_pok, stride_plt, stride_plh,
                              BLOCK_M, HEAD_DIM)
    else:
        o = acc / l_safe[:, None]
        optrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(optrs, o.to(out_ptr.dtype.element_ty), mask=mmask[:, None])


@triton.jit
def _verify_reduce_kernel(out_ptr, part_out_ptr, part_lse_ptr, qsl_ptr, seq_lens_ptr, num_splits,
                          stride_ot, stride_oh, stride_pot, stride_poh, stride_pok, stride_plt, stride_plh,
                          GROUP: tl.constexpr, Q_LEN: tl.constexpr, BLOCK_M: tl.constexpr,
                          HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr,
                          USE_PDL: tl.constexpr, WINDOW: tl.constexpr = 0):
    """The split merge as a pass of its own (metadata without split counters): grid
    (num_seqs, num_kv_heads); recomputes how many splits of the row ran."""
    pdl_start(USE_PDL)
    seq = tl.program_id(0)
    q_tok = tl.load(qsl_ptr + seq)
    n_q = tl.load(qsl_ptr + seq + 1) - q_tok
    if n_q <= 0:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    chunk, _, span = _verify_split_range(seq_len, n_q, 0, num_splits, BLOCK_N, MIN_CHUNK, WINDOW)
    _, tok, head, mmask = _query_rows(q_tok, n_q, tl.program_id(1) * GROUP, GROUP, Q_LEN, BLOCK_M)
    _verify_merge(out_ptr, part_out_ptr, part_lse_ptr, tok, head, mmask, tl.cdiv(span, chunk), stride_ot,
                  stride_oh, stride_pot, stride_poh, stride_pok, stride_plt, stride_plh, BLOCK_M, HEAD_DIM)
