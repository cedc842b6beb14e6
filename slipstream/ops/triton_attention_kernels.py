"""The Triton decode kernels of paged attention (launched by `slipstream.ops.triton_attention`,
whose module docstring describes them): split-KV decode with the in-kernel split merge, and
the separate merge pass. The pieces they share with the verify and the mixed prefill/decode
kernels (ops/triton_verify_kernel.py, ops/triton_prefill_kernel.py) are in
`slipstream.ops.triton_attention_tiles`; here are the decode kernel's own: the first tile
loaded before the PDL wait and attended after it.

An FP8 cache (KV_FP8, `ops/kv_quant.py`): K and V tiles are loaded as float8_e4m3fn and
upcast before their dots to float16 (float32 for a float32 q), exactly: every e4m3 value is
a float16 value, and e4m3 -> float16 is one conversion for two values on sm_89+, where
bf16 would take a second one a value.  A bf16 q is cast to float16 once
(`fp8_dot_q`: exact for |q| in [2^-14, 65504], the range of attention's queries), so the
products are those of the bf16 kernel and P is rounded to float16 (3 more bits than bf16).
The host folds k_scale into qk_scale and the kernels multiply the output by v_scale
(attention is linear in V).  Without KV_FP8 the kernels compile as they did
(benchmarks/ptx_diff.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

from slipstream.ops.pdl import pdl_start
from slipstream.ops.triton_attention_tiles import (attend_tile, decode_row, fp8_dot_q, kv_rows, merge_splits, row_start,
                                                    softmax_weights, split_range, zero_tail)
from slipstream.ops.triton_dot import dot
from slipstream.ops.triton_qkv_heads import decode_epilogue, decode_epilogue_inputs

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
    seq, q_tok, q_end = decode_row(order_ptr, qsl_ptr, pid, HAS_ORDER)
    seq_len = tl.load(seq_lens_ptr + seq)
    chunk, start, span = split_range(seq_len, split, num_splits, BLOCK_N, MIN_CHUNK, WINDOW)
    end = tl.minimum(start + chunk, seq_len)
    acc, l_i, m_i, bt_row, k_head_off, v_head_off = row_start(bt_ptr, seq, stride_bt, kvh, stride_kch,
                                                               stride_vch, BLOCK_G, HEAD_DIM)
    live = (q_end - q_tok == 1) & (start < end)  # a decode row with work in this split
    pos0, _, k_rows, v_rows = kv_rows(bt_row, k_head_off, v_head_off, start, tl.where(live, end, 0),
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
    p, alpha, l_i, m_new = softmax_weights(s, m_i, l_i)
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
            zero_tail(out_ptr, qsl_ptr, num_seqs, num_tokens, head0, stride_ot, stride_oh,
                       GROUP, BLOCK_G, HEAD_DIM)
    if not PREFETCH:
        seq, q_tok, q_end = decode_row(order_ptr, qsl_ptr, pid, HAS_ORDER)
    if q_end <= q_tok:
        return  # no query token in this row
    if SINGLE_ONLY:
        if q_end - q_tok != 1:
            return  # a mixed batch's prefill row: the prefill kernel's
    if not PREFETCH:
        seq_len = tl.load(seq_lens_ptr + seq)
    chunk, start, span = split_range(seq_len, split, num_splits, BLOCK_N, MIN_CHUNK, WINDOW)
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
        q = fp8_dot_q(q)
    if not PREFETCH:
        acc, l_i, m_i, bt_row, k_head_off, v_head_off = row_start(bt_ptr, seq, stride_bt, kvh, stride_kch,
                                                                   stride_vch, BLOCK_G, HEAD_DIM)
    full_end = start + ((end - start) // BLOCK_N) * BLOCK_N
    first = start
    if PREFETCH:
        acc, l_i, m_i = _attend_prefetched_tile(acc, l_i, m_i, q, pos0, k0_ptrs, v0_ptrs, k0, v0, seq_len,
                                                end, qk_scale, IEEE, UPCAST, KV_FP8)
        first = start + BLOCK_N
        full_end = tl.maximum(full_end, first)
    for t in range(first, full_end, BLOCK_N):
        acc, l_i, m_i = attend_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row,
                                     k_head_off, v_head_off, t, end, offs_g, qk_scale,
                                     stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                                     BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, False, IEEE, UPCAST,
                                     KV_FP8=KV_FP8)
    if full_end < end:
        acc, l_i, m_i = attend_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row,
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
                merge_splits(out_ptr, part_out_ptr, part_lse_ptr, seq, q_tok, head0, n_valid,
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
    chunk, _, span = split_range(seq_len, 0, num_splits, BLOCK_N, MIN_CHUNK, WINDOW)
    n_valid = tl.cdiv(span, chunk)
    merge_splits(out_ptr, part_out_ptr, part_lse_ptr, seq, q_tok, tl.program_id(1) * GROUP, n_valid,
                  stride_ot, stride_oh, stride_pos, stride_poh, stride_pok, stride_pls, stride_plh,
                  GROUP, BLOCK_G, HEAD_DIM)
