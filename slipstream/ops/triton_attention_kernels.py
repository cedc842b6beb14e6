"""The Triton kernels of paged attention (launched by `slipstream.ops.triton_attention`, whose
module docstring describes them): split-KV decode with the in-kernel split merge, the
separate merge pass (the mixed prefill/decode kernel, which shares the tile helpers, is in
`slipstream.ops.triton_prefill_kernel`).  Shared pieces: `_attend_tile`
(one KV tile of online softmax), `_chunk_len` (a row's
split length, recomputed the same way by every kernel that needs it), `_merge_splits` (the
log-sum-exp merge, in the decode kernel's last split or in the separate pass).

An FP8 cache (KV_FP8, `ops/kv_quant.py`): K and V tiles are loaded as float8_e4m3fn and
upcast before their dots to float16 (float32 for a float32 q), exactly: every e4m3 value is
a float16 value, and e4m3 -> float16 is one conversion for two values on sm_89+, where
bf16 would take a second one a value.  A bf16 q is cast to float16 once
(`_fp8_dot_q`: exact for |q| in [2^-14, 65504], the range of attention's queries), so the
products are those of the bf16 kernel and P is rounded to float16 (3 more bits than bf16).
The host folds k_scale into qk_scale and the kernels multiply the output by v_scale
(attention is linear in V).  Without KV_FP8 the kernels compile as they did
(benchmarks/ptx_diff.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

from slipstream.ops.pdl import pdl_start
from slipstream.ops.triton_dot import dot
from slipstream.ops.triton_qkv_heads import decode_epilogue, decode_epilogue_inputs

_NEG_INIT = tl.constexpr(-1.0e30)  # finite running-max start: fully masked rows never make NaN


@triton.jit
def _fp8_dot_q(q):
    """q in the dtype of the FP8 cache's dots (module doc): float16 for a bf16 q."""
    return q.to(tl.float16 if q.dtype == tl.bfloat16 else q.dtype)


@triton.jit
def _kv_rows(bt_row_ptr, k_head_off, v_head_off, t, kv_end, stride_kcb, stride_kcs, stride_vcb,
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
def _softmax_weights(s, m_i, l_i):
    """Online softmax over one tile of scores s [rows, BLOCK_N] (masked ones -inf): the
    tile's weights p, the rescale alpha of what came before, and the new l and m."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, l_i, m_new


@triton.jit
def _attend_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row_ptr, k_head_off, v_head_off,
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
    pos, nmask, k_rows, v_rows = _kv_rows(bt_row_ptr, k_head_off, v_head_off, t, kv_end, stride_kcb,
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
    p, alpha, l_i, m_new = _softmax_weights(s, m_i, l_i)
    if MASK_END:
        v = tl.load(v_ptrs, mask=nmask[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    if KV_FP8:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, None, IEEE, UPCAST)
    return acc, l_i, m_new


@triton.jit
def _zero_tail(out_ptr, qsl_ptr, num_seqs, num_tokens, head0, stride_ot, stride_oh,
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
def _chunk_len(seq_len, num_splits, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr):
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(chunk, MIN_CHUNK)


@triton.jit
def _split_range(seq_len, split, num_splits, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr,
                 WINDOW: tl.constexpr):
    """A decode row's keys are [seq_len - span, seq_len) (span = seq_len, or at most WINDOW of
    them): its split length, this split's first position, and the span."""
    if WINDOW > 0:
        span = tl.minimum(seq_len, WINDOW)
        chunk = _chunk_len(span, num_splits, BLOCK_N, MIN_CHUNK)
        start = seq_len - span + split * chunk
    else:
        span = seq_len
        chunk = _chunk_len(seq_len, num_splits, BLOCK_N, MIN_CHUNK)
        start = split * chunk
    return chunk, start, span


@triton.jit
def _row_start(bt_ptr, seq, stride_bt, kvh, stride_kch, stride_vch, ROWS: tl.constexpr,
               HEAD_DIM: tl.constexpr):
    """Online-softmax state (acc, l, m) of ROWS query rows, and the row's block-table
    pointer and KV-head offsets into the caches."""
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    m_i = tl.full([ROWS], _NEG_INIT, dtype=tl.float32)
    return acc, l_i, m_i, bt_ptr + seq.to(tl.int64) * stride_bt, kvh * stride_kch, kvh * stride_vch


@triton.jit
def _merge_splits(out_ptr, part_out_ptr, part_lse_ptr, seq, q_tok, head0, n_valid,
                  stride_ot, stride_oh, stride_pos, stride_poh, stride_pok, stride_pls, stride_plh,
                  GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Log-sum-exp merge of a row's `n_valid` split partials for heads [head0, head0 + GROUP),
    in split order (deterministic); n_valid == 0 (a padding row) writes zeros.  Loads bypass
    L1: the partials come from other SMs."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    gmask = offs_g < GROUP
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], _NEG_INIT, dtype=tl.float32)
    po = part_out_ptr + seq.to(tl.int64) * stride_pos + (head0 + offs_g[:, None]) * stride_poh + offs_d[None, :]
    pl = part_lse_ptr + seq * stride_pls + (head0 + offs_g) * stride_plh
    for sp in range(0, n_valid):
        lse = tl.load(pl + sp, mask=gmask, other=0.0, cache_modifier=".cg")
        part = tl.load(po + sp * stride_pok, mask=gmask[:, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_i, lse)
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + part * w[:, None]
        l_i = l_i * alpha + w
        m_i = m_new
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # l_i >= 1 once a split is merged
    o = acc / l_safe[:, None]
    optrs = out_ptr + q_tok * stride_ot + (head0 + offs_g[:, None]) * stride_oh + offs_d[None, :]
    tl.store(optrs, o.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


@triton.jit
def _decode_row(order_ptr, qsl_ptr, pid, HAS_ORDER: tl.constexpr):
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


@triton.jit
def _prefetch_first_tile(k_cache_ptr, v_cache_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, order_ptr, pid, split,
                         kvh, num_splits, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs,
                         stride_vch, stride_bt, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr,
                         HAS_ORDER: tl.constexpr, WINDOW: tl.constexpr):
    """Before the PDL wait (ops/pdl.py), only what no kernel of the step writes: the row's
    metadata (uploaded before the step) and the K/V of its split's first tile at positions
    below seq_len - 1 (written by earlier steps).  The newest position, seq_len - 1, is the
    one the qkv epilogue (the kernel before) is writing: `_attend_prefetched_tile` reads it
    after the wait.  Loads only, no stores; a row with nothing to do here loads no K/V."""
    seq, q_tok, q_end = _decode_row(order_ptr, qsl_ptr, pid, HAS_ORDER)
    seq_len = tl.load(seq_lens_ptr + seq)
    chunk, start, span = _split_range(seq_len, split, num_splits, BLOCK_N, MIN_CHUNK, WINDOW)
    end = tl.minimum(start + chunk, seq_len)
    acc, l_i, m_i, bt_row, k_head_off, v_head_off = _row_start(bt_ptr, seq, stride_bt, kvh, stride_kch,
                                                               stride_vch, BLOCK_G, HEAD_DIM)
    live = (q_end - q_tok == 1) & (start < end)  # a decode row with work in this split
    pos0, _, k_rows, v_rows = _kv_rows(bt_row, k_head_off, v_head_off, start, tl.where(live, end, 0),
                                       stride_kcb, stride_kcs, stride_vcb, stride_vcs, BLOCK_SIZE,
                                       BLOCK_N, True, 0, 0)
    offs_d = tl.arange(0, HEAD_DIM)
    k0_ptrs = k_cache_ptr + (k_rows[:, None] + offs_d[None, :])
    v0_ptrs = v_cache_ptr + (v_rows[:, None] + offs_d[None, :])
    old = (pos0 < tl.where(live, tl.minimum(end, seq_len - 1), 0))[:, None]
    k0 = tl.load(k0_ptrs, mask=old, other=0.0)
    v0 = tl.load(v0_ptrs, mask=old, other=0.0)
    return (seq, q_tok, q_end, seq_len, acc, l_i, m_i, bt_row, k_head_off, v_head_off, pos0, k0_ptrs,
            v0_ptrs, k0, v0)


@triton.jit
def _attend_prefetched_tile(acc, l_i, m_i, q, pos0, k0_ptrs, v0_ptrs, k0, v0, seq_len, end, qk_scale,
                            IEEE: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr = False):
    """The online-softmax step over the prefetched first tile, after the PDL wait: its
    newest position (if in it) is loaded now; positions >= end are masked."""
    newest = ((pos0 == seq_len - 1) & (pos0 < end))[:, None]
    if KV_FP8:  # upcast first: the select then works on q's dtype
        k0 = tl.where(newest, tl.load(k0_ptrs, mask=newest, other=0.0).to(q.dtype), k0.to(q.dtype))
        v0 = tl.where(newest, tl.load(v0_ptrs, mask=newest, other=0.0).to(q.dtype), v0.to(q.dtype))
    else:
        k0 = tl.where(newest, tl.load(k0_ptrs, mask=newest, other=0.0), k0)
        v0 = tl.where(newest, tl.load(v0_ptrs, mask=newest, other=0.0), v0)
    s = dot(q, tl.trans(k0), None, IEEE, UPCAST) * qk_scale
    s = tl.where((pos0 < end)[None, :], s, float("-inf"))
    p, alpha, l_i, m_new = _softmax_weights(s, m_i, l_i)
    acc = acc * alpha[:, None] + dot(p.to(v0.dtype), v0, None, IEEE, UPCAST)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_splits"])  # no recompiles per step
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                   qsl_ptr, seq_lens_ptr, bt_ptr, order_ptr, counter_ptr, qk_scale, num_seqs,
                   num_tokens, num_splits, stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                   stride_bt, stride_pos, stride_poh, stride_pok, stride_pls, stride_plh,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr,
                   SPLIT: tl.constexpr, HAS_ORDER: tl.constexpr, MERGE: tl.constexpr,
                   SINGLE_ONLY: tl.constexpr, NUM_KV_HEADS: tl.constexpr, IEEE: tl.constexpr,
                   UPCAST: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr = False,
                   # the qkv epilogue inside (EPILOGUE): q_ptr is then qkv's q columns, unrotated
                   pos_ptr=None, cs_ptr=None, slot_ptr=None, qw_ptr=None, kw_ptr=None, stride_cs=None,
                   eps=None, EPILOGUE: tl.constexpr = False, Q_NORM: tl.constexpr = False,
                   K_NORM: tl.constexpr = False, WINDOW: tl.constexpr = 0,
                   v_scale=None, KV_FP8: tl.constexpr = False, k_inv_scale=None, v_inv_scale=None):
    # KV_FP8: an FP8 cache (module doc); qk_scale carries k_scale, the output gets v_scale;
    # with EPILOGUE the newest K/V are stored times k_inv_scale / v_inv_scale.
    # WINDOW > 0: a row attends to its last WINDOW positions only (its query is the newest);
    # the splits divide those.
    # EPILOGUE (small decode batches, `DecodeConfig.epilogue_batch`): this kernel also does the
    # qkv epilogue's work (`decode_epilogue`), so a layer has one kernel fewer.  Each
    # program rotates its own q heads; the program whose split holds the row's newest
    # position stores that position's K/V, before any tile load of its own reads it.
    # PREFETCH (small batches, `DecodeConfig.prefetch_batch`): the row's metadata and its
    # first KV tile are loaded before the PDL wait (`_prefetch_first_tile`).  Without it every
    # statement below runs in the order whose speed was measured: `if not PREFETCH` keeps
    # those kernels' compiled code as it was (benchmarks/ptx_diff.py: same PTX).
    if not PREFETCH:
        pdl_start(USE_PDL)
    # One flat grid, (row, KV head, split) with the split fastest: the hardware starts
    # programs in id order, so with rows longest first every KV head of the longest row
    # starts first and the whole grid runs longest-work-first (a grid with the KV head as
    # its own axis would start the last head's long rows near the end).
    prog = tl.program_id(0)
    split = prog % num_splits
    kvh = (prog // num_splits) % NUM_KV_HEADS
    pid = prog // (num_splits * NUM_KV_HEADS)
    head0 = kvh * GROUP
    if PREFETCH:
        (seq, q_tok, q_end, seq_len, acc, l_i, m_i, bt_row, k_head_off, v_head_off, pos0, k0_ptrs,
         v0_ptrs, k0, v0) = _prefetch_first_tile(
            k_cache_ptr, v_cache_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, order_ptr, pid, split, kvh,
            num_splits, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
            stride_bt, BLOCK_G, HEAD_DIM, BLOCK_SIZE, BLOCK_N, MIN_CHUNK, HAS_ORDER, WINDOW)
        if EPILOGUE:
            cos, sin, slot = decode_epilogue_inputs(pos_ptr, cs_ptr, slot_ptr, q_tok, stride_cs, HEAD_DIM // 2)
        pdl_start(USE_PDL)
    if pid == 0:
        if split == 0:
            _zero_tail(out_ptr, qsl_ptr, num_seqs, num_tokens, head0, stride_ot, stride_oh,
                       GROUP, BLOCK_G, HEAD_DIM)
    if not PREFETCH:
        seq, q_tok, q_end = _decode_row(order_ptr, qsl_ptr, pid, HAS_ORDER)
    if q_end <= q_tok:
        return  # no query token in this row
    if SINGLE_ONLY:
        if q_end - q_tok != 1:
            return  # a mixed batch's prefill row: the prefill kernel's
    if not PREFETCH:
        seq_len = tl.load(seq_lens_ptr + seq)
    chunk, start, span = _split_range(seq_len, split, num_splits, BLOCK_N, MIN_CHUNK, WINDOW)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    gmask = offs_g < GROUP
    if SPLIT:
        if start >= seq_len:
            if MERGE:  # no reduce pass: a context-free row's output is written here
                if (seq_len == 0) & (split == 0):
                    optrs = out_ptr + q_tok * stride_ot + (head0 + offs_g[:, None]) * stride_oh + offs_d[None, :]
                    tl.store(optrs, tl.zeros([BLOCK_G, HEAD_DIM], dtype=out_ptr.dtype.element_ty),
                             mask=gmask[:, None])
            return  # past the end (the merge ignores this split)
    end = tl.minimum(start + chunk, seq_len)

    if EPILOGUE:
        if not PREFETCH:
            cos, sin, slot = decode_epilogue_inputs(pos_ptr, cs_ptr, slot_ptr, q_tok, stride_cs, HEAD_DIM // 2)
        q = decode_epilogue(q_ptr + q_tok * stride_qt, qw_ptr, kw_ptr, k_cache_ptr, v_cache_ptr, cos, sin,
                            slot, kvh, NUM_KV_HEADS, eps, stride_kcb, stride_kcs, stride_kch, stride_vcb,
                            stride_vcs, stride_vch, (start <= seq_len - 1) & (seq_len - 1 < end),
                            GROUP, BLOCK_G, HEAD_DIM // 2, BLOCK_SIZE, Q_NORM, K_NORM,
                            k_inv_scale, v_inv_scale, KV_FP8)
    else:
        q = tl.load(q_ptr + q_tok * stride_qt + (head0 + offs_g[:, None]) * stride_qh + offs_d[None, :],
                    mask=gmask[:, None], other=0.0)
    if KV_FP8:
        q = _fp8_dot_q(q)
    if not PREFETCH:
        acc, l_i, m_i, bt_row, k_head_off, v_head_off = _row_start(bt_ptr, seq, stride_bt, kvh, stride_kch,
                                                                   stride_vch, BLOCK_G, HEAD_DIM)
    full_end = start + ((end - start) // BLOCK_N) * BLOCK_N
    first = start
    if PREFETCH:
        acc, l_i, m_i = _attend_prefetched_tile(acc, l_i, m_i, q, pos0, k0_ptrs, v0_ptrs, k0, v0, seq_len,
                                                end, qk_scale, IEEE, UPCAST, KV_FP8)
        first = start + BLOCK_N
        full_end = tl.maximum(full_end, first)
    for t in range(first, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row,
                                     k_head_off, v_head_off, t, end, offs_g, qk_scale,
                                     stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                                     BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, False, IEEE, UPCAST,
                                     KV_FP8=KV_FP8)
    if full_end < end:
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row,
                                     k_head_off, v_head_off, full_end, end, offs_g, qk_scale,
                                     stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                                     BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, False, IEEE, UPCAST,
                                     KV_FP8=KV_FP8)
    if KV_FP8:  # (the split partials too: their merge is linear in them)
        acc = acc * v_scale
    if SPLIT:
        # start < seq_len here, so every row saw >= 1 valid position: l_i > 0.
        po = (part_out_ptr + seq.to(tl.int64) * stride_pos + (head0 + offs_g[:, None]) * stride_poh
              + split * stride_pok + offs_d[None, :])
        tl.store(po, acc / l_i[:, None], mask=gmask[:, None])
        pl = part_lse_ptr + seq * stride_pls + (head0 + offs_g) * stride_plh + split
        tl.store(pl, m_i + tl.log2(l_i), mask=gmask)
        if MERGE:
            # The last split of (row, KV head) to finish merges them all (no reduce launch).
            # Barrier: every thread's partial is stored before the release; the counter is
            # reset by that last program, ready for the next layer / step.
            tl.debug_barrier()
            cnt = counter_ptr + seq * NUM_KV_HEADS + kvh
            done = tl.atomic_add(cnt, 1, sem="acq_rel")
            n_valid = tl.cdiv(span, chunk)
            if done == n_valid - 1:
                tl.atomic_xchg(cnt, 0)
                _merge_splits(out_ptr, part_out_ptr, part_lse_ptr, seq, q_tok, head0, n_valid,
                              stride_ot, stride_oh, stride_pos, stride_poh, stride_pok,
                              stride_pls, stride_plh, GROUP, BLOCK_G, HEAD_DIM)
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # seq_len == 0: acc == 0 -> output 0
        o = acc / l_safe[:, None]
        optrs = out_ptr + q_tok * stride_ot + (head0 + offs_g[:, None]) * stride_oh + offs_d[None, :]
        tl.store(optrs, o.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


@triton.jit
def _decode_reduce_kernel(out_ptr, part_out_ptr, part_lse_ptr, qsl_ptr, seq_lens_ptr, num_splits,
                          stride_ot, stride_oh, stride_pos, stride_poh, stride_pok,
                          stride_pls, stride_plh,
                          GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr, USE_PDL: tl.constexpr,
                          WINDOW: tl.constexpr = 0):
    """The split merge as a pass of its own (metadata without split counters): grid
    (num_seqs, num_kv_heads); recomputes how many splits of the row ran."""
    pdl_start(USE_PDL)
    seq = tl.program_id(0)
    q_tok = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)
    if q_end <= q_tok:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    chunk, _, span = _split_range(seq_len, 0, num_splits, BLOCK_N, MIN_CHUNK, WINDOW)
    n_valid = tl.cdiv(span, chunk)
    _merge_splits(out_ptr, part_out_ptr, part_lse_ptr, seq, q_tok, tl.program_id(1) * GROUP, n_valid,
                  stride_ot, stride_oh, stride_pos, stride_poh, stride_pok, stride_pls, stride_plh,
                  GROUP, BLOCK_G, HEAD_DIM)
