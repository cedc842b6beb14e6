"""The pieces of paged attention that the decode, verify and prefill kernels share, as Triton
device functions: `attend_tile` (one KV tile of online softmax, bf16/f16 or FP8 K and V),
`kv_rows` (a tile's rows in the paged cache), `chunk_len` / `split_range` (a row's split of
its keys, recomputed the same way by every kernel that needs it), `row_start`, `decode_row`,
`merge_splits` (the log-sum-exp merge of a row's splits, in the decode kernel's last split or
in the separate pass), `zero_tail` (output rows past the batch) and `fp8_dot_q` (q's dtype
for an FP8 cache's dots: ops/triton_attention_kernels.py's docstring says why).
"""
from __future__ import annotations

import triton
import triton.language as tl

from slipstream.ops.triton_dot import dot

NEG_INIT = tl.constexpr(-1.0e30)  # finite running-max start: fully masked rows never make NaN


@triton.jit
def fp8_dot_q(q):
    """q in the dtype of the FP8 cache's dots (module doc): float16 for a bf16 q."""
    return q.to(tl.float16 if q.dtype == tl.bfloat16 else q.dtype)


@triton.jit
def kv_rows(bt_row_ptr, k_head_off, v_head_off, t, kv_end, stride_kcb, stride_kcs, stride_vcb,
             stride_vcs, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK_END: tl.constexpr,
             kv_lo, WINDOW: tl.constexpr):
    """Positions [t, t + BLOCK_N) and their cache row offsets in K and V (MASK_END: positions
    >= kv_end read no block-table entry), and the mask pos < kv_end (MASK_END only); with a
    WINDOW, positions below kv_lo are masked too (their blocks may have been freed)."""
    pos = t + tl.arange(0, BLOCK_N)
    if MASK_END:
        nmask = pos < kv_end
        if WINDOW > 0:
            nmask = nmask & (pos >= kv_lo)
        blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
    else:
        nmask = pos >= 0  # unused
        blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE).to(tl.int64)
    in_blk = pos % BLOCK_SIZE
    k_rows = blk * stride_kcb + in_blk * stride_kcs + k_head_off
    v_rows = blk * stride_vcb + in_blk * stride_vcs + v_head_off
    return pos, nmask, k_rows, v_rows


@triton.jit
def softmax_weights(s, m_i, l_i):
    """Online softmax over one tile of scores s [rows, BLOCK_N] (masked ones -inf): the
    tile's weights p, the rescale alpha of what came before, and the new l and m."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, l_i, m_new


@triton.jit
def attend_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row_ptr, k_head_off, v_head_off,
                 t, kv_end, row_pos, qk_scale, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 MASK_END: tl.constexpr, CAUSAL: tl.constexpr,
                 IEEE: tl.constexpr, UPCAST: tl.constexpr, kv_lo=0, WINDOW: tl.constexpr = 0,
                 KV_FP8: tl.constexpr = False):
    """One online-softmax step over KV positions [t, t + BLOCK_N) of one sequence/KV head.

    MASK_END: positions >= kv_end are masked (else the whole tile must be valid).
    CAUSAL: position p is masked for a row whose absolute position row_pos < p, and with a
    WINDOW for a row with row_pos - WINDOW >= p (keys in (row_pos - WINDOW, row_pos]).
    V is loaded after the softmax arithmetic (the order its pipelining was measured in).
    """
    offs_d = tl.arange(0, HEAD_DIM)
    pos, nmask, k_rows, v_rows = kv_rows(bt_row_ptr, k_head_off, v_head_off, t, kv_end, stride_kcb,
                                          stride_kcs, stride_vcb, stride_vcs, BLOCK_SIZE, BLOCK_N,
                                          MASK_END, kv_lo, WINDOW)
    k_ptrs = k_cache_ptr + (k_rows[:, None] + offs_d[None, :])
    v_ptrs = v_cache_ptr + (v_rows[:, None] + offs_d[None, :])
    if MASK_END:
        k = tl.load(k_ptrs, mask=nmask[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
    if KV_FP8:
        k = k.to(q.dtype)
    s = dot(q, tl.trans(k), None, IEEE, UPCAST) * qk_scale
    if CAUSAL:
        keep = pos[None, :] <= row_pos[:, None]
        if WINDOW > 0:
            keep = keep & (pos[None, :] > row_pos[:, None] - WINDOW)
        if MASK_END:
            keep = keep & nmask[None, :]
        s = tl.where(keep, s, float("-inf"))
    elif MASK_END:
        s = tl.where(nmask[None, :], s, float("-inf"))
    p, alpha, l_i, m_new = softmax_weights(s, m_i, l_i)
    if MASK_END:
        v = tl.load(v_ptrs, mask=nmask[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    if KV_FP8:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, None, IEEE, UPCAST)
    return acc, l_i, m_new


@triton.jit
def zero_tail(out_ptr, qsl_ptr, num_seqs, num_tokens, head0, stride_ot, stride_oh,
               GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Zero the heads [head0, head0 + GROUP) of tokens past the last sequence."""
    first = tl.load(qsl_ptr + num_seqs)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    gmask = offs_g[:, None] < GROUP
    zeros = tl.zeros([BLOCK_G, HEAD_DIM], dtype=out_ptr.dtype.element_ty)
    ptrs = out_ptr + (head0 + offs_g[:, None]) * stride_oh + offs_d[None, :]
    for t in range(first, num_tokens):
        tl.store(ptrs + t * stride_ot, zeros, mask=gmask)


@triton.jit
def chunk_len(seq_len, num_splits, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr):
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(chunk, MIN_CHUNK)


@triton.jit
def split_range(seq_len, split, num_splits, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr,
                 WINDOW: tl.constexpr):
    """A decode row's keys are [seq_len - span, seq_len) (span = seq_len, or at most WINDOW of
    them): its split length, this split's first position, and the span."""
    if WINDOW > 0:
        span = tl.minimum(seq_len, WINDOW)
        chunk = chunk_len(span, num_splits, BLOCK_N, MIN_CHUNK)
        start = seq_len - span + split * chunk
    else:
        span = seq_len
        chunk = chunk_len(seq_len, num_splits, BLOCK_N, MIN_CHUNK)
        start = split * chunk
    return chunk, start, span


@triton.jit
def row_start(bt_ptr, seq, stride_bt, kvh, stride_kch, stride_vch, ROWS: tl.constexpr,
               HEAD_DIM: tl.constexpr):
    """Online-softmax state (acc, l, m) of ROWS query rows, and the row's block-table
    pointer and KV-head offsets into the caches."""
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    m_i = tl.full([ROWS], NEG_INIT, dtype=tl.float32)
    return acc, l_i, m_i, bt_ptr + seq.to(tl.int64) * stride_bt, kvh * stride_kch, kvh * stride_vch


@triton.jit
def lse_merge(po, pl, mask, n_valid, stride_pok, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
              MASKED_LSE: tl.constexpr = 0.0):
    """Log-sum-exp merge of `n_valid` split partials, in split order (deterministic): partial
    `sp` of the BLOCK rows is at po + sp * stride_pok ([BLOCK, HEAD_DIM] pointers), its log2
    sum-exp at pl + sp; the merged rows in float32, zeros when n_valid == 0.  Loads bypass
    L1: the partials come from other SMs. MASKED_LSE: what masked-out rows load (they are
    not stored; each caller keeps the constant its compiled code was measured with)."""
    acc = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK], dtype=tl.float32)
    m_i = tl.full([BLOCK], NEG_INIT, dtype=tl.float32)
    for sp in range(0, n_valid):
        lse = tl.load(pl + sp, mask=mask, other=MASKED_LSE, cache_modifier=".cg")
        part = tl.load(po + sp * stride_pok, mask=mask[:, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_i, lse)
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + part * w[:, None]
        l_i = l_i * alpha + w
        m_i = m_new
    return acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # l_i >= 1 once a split is merged


@triton.jit
def merge_splits(out_ptr, part_out_ptr, part_lse_ptr, seq, q_tok, head0, n_valid,
                  stride_ot, stride_oh, stride_pos, stride_poh, stride_pok, stride_pls, stride_plh,
                  GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr):
    """`lse_merge` of a row's `n_valid` split partials for heads [head0, head0 + GROUP) into
    the output; n_valid == 0 (a padding row) writes zeros."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    gmask = offs_g < GROUP
    po = part_out_ptr + seq.to(tl.int64) * stride_pos + (head0 + offs_g[:, None]) * stride_poh + offs_d[None, :]
    pl = part_lse_ptr + seq * stride_pls + (head0 + offs_g) * stride_plh
    o = lse_merge(po, pl, gmask, n_valid, stride_pok, BLOCK_G, HEAD_DIM)
    optrs = out_ptr + q_tok * stride_ot + (head0 + offs_g[:, None]) * stride_oh + offs_d[None, :]
    tl.store(optrs, o.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


@triton.jit
def decode_row(order_ptr, qsl_ptr, pid, HAS_ORDER: tl.constexpr):
    """The batch row a decode program serves, and its query tokens [q_tok, q_end).
    HAS_ORDER: programs take rows longest first (order = argsort(-seq_lens), built on the
    host), so the last programs to start are the short rows: no long tail on ragged batches."""
    if HAS_ORDER:
        seq = tl.load(order_ptr + pid)
    else:
        seq = pid
    q_tok = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)
    return seq, q_tok, q_end
