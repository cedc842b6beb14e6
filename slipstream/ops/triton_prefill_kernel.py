"""The Triton prefill / mixed-batch paged-attention kernel (launched by
`slipstream.ops.triton_attention.prefill_attention`; the tile helpers it shares with the
decode kernel are in `slipstream.ops.triton_attention_tiles`)."""
from __future__ import annotations

import triton
import triton.language as tl

from slipstream.ops.pdl import pdl_start
from slipstream.ops.triton_attention_tiles import attend_tile, fp8_dot_q, row_start, zero_tail


@triton.jit(do_not_specialize=["num_seqs", "num_tokens"])  # vary per step: no recompiles
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, qsl_ptr, seq_lens_ptr, bt_ptr,
                    qk_scale, num_seqs, num_tokens,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                    stride_bt,
                    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_N: tl.constexpr, WIDE_N: tl.constexpr, SEQ_CHUNK: tl.constexpr,
                    SKIP_SINGLE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                    USE_PDL: tl.constexpr, WINDOW: tl.constexpr = 0,
                    v_scale=None, KV_FP8: tl.constexpr = False):
    # KV_FP8: an FP8 cache (triton_attention_kernels' doc): qk_scale carries k_scale, the
    # output gets v_scale
    pdl_start(USE_PDL)
    # Reversed order: the longest (last) query tiles of the batch start first, the short
    # ones fill the tail.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    head0 = kvh * GROUP
    if tl.program_id(0) == 0:
        zero_tail(out_ptr, qsl_ptr, num_seqs, num_tokens, head0, stride_ot, stride_oh,
                   GROUP, GROUP_P, HEAD_DIM)
    # Find the sequence: the number of s with  qsl[s] // BLOCK_Q + s <= pid, minus one.
    count = tl.zeros([SEQ_CHUNK], dtype=tl.int32)
    for s0 in range(0, num_seqs, SEQ_CHUNK):
        offs_s = s0 + tl.arange(0, SEQ_CHUNK)
        smask = offs_s < num_seqs
        st = tl.load(qsl_ptr + offs_s, mask=smask, other=0)
        first_tile = st // BLOCK_Q + offs_s
        count += (smask & (first_tile <= pid)).to(tl.int32)
    seq = tl.sum(count, 0) - 1
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    tok0 = (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if tok0 >= q_len:
        return
    if SKIP_SINGLE:
        if q_len == 1:
            return  # the decode kernel's row
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # absolute position of the sequence's first query token

    rows = tl.arange(0, BLOCK_M)
    r_tok = tok0 + rows // GROUP_P
    r_head = rows % GROUP_P
    rmask = (r_tok < q_len) & (r_head < GROUP)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_start + r_tok[:, None]) * stride_qt + (head0 + r_head[:, None]) * stride_qh
                + offs_d[None, :], mask=rmask[:, None], other=0.0)
    if KV_FP8:
        q = fp8_dot_q(q)
    row_pos = ctx + r_tok

    acc, l_i, m_i, bt_row, k_head_off, v_head_off = row_start(bt_ptr, seq, stride_bt, kvh, stride_kch,
                                                               stride_vch, BLOCK_M, HEAD_DIM)
    # KV positions every row of the tile sees: [0, ctx + tok0]; the last row sees up to
    # ctx + tok0 + BLOCK_Q - 1 (clipped to the sequence).
    seen_by_all = tl.maximum(ctx + tok0 + 1, 0)
    kv_end = tl.minimum(seq_len, ctx + tok0 + BLOCK_Q)
    full_end = (seen_by_all // BLOCK_N) * BLOCK_N
    t_narrow = 0
    kv_lo = 0
    if WINDOW > 0:
        # Keys from kv_lo (the first row's oldest) on; below win_full some row of the tile
        # has already lost a key out of its window: those tiles are masked.
        kv_lo = tl.maximum(ctx + tok0 + 1 - WINDOW, 0)
        win_full = tl.cdiv(tl.maximum(ctx + tok0 + BLOCK_Q - WINDOW, 0), BLOCK_N) * BLOCK_N
        win_full = tl.minimum(win_full, full_end)
        for t in range((kv_lo // BLOCK_N) * BLOCK_N, win_full, BLOCK_N):
            acc, l_i, m_i = attend_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row,
                                         k_head_off, v_head_off, t, kv_end, row_pos, qk_scale,
                                         stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                                         BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, True, IEEE, UPCAST,
                                         kv_lo, WINDOW, KV_FP8)
        t_narrow = win_full
        if WIDE_N > 0:
            wide_end = win_full + ((seen_by_all - win_full) // WIDE_N) * WIDE_N
            for t in range(win_full, wide_end, WIDE_N):
                acc, l_i, m_i = attend_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row,
                                             k_head_off, v_head_off, t, kv_end, row_pos, qk_scale,
                                             stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                                             BLOCK_SIZE, WIDE_N, HEAD_DIM, False, False, IEEE, UPCAST,
                                             KV_FP8=KV_FP8)
            t_narrow = wide_end
    elif WIDE_N > 0:  # the tiles every row sees in full, WIDE_N at a time (fewer, larger dots)
        t_narrow = (seen_by_all // WIDE_N) * WIDE_N
        for t in range(0, t_narrow, WIDE_N):
            acc, l_i, m_i = attend_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row,
                                         k_head_off, v_head_off, t, kv_end, row_pos, qk_scale,
                                         stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                                         BLOCK_SIZE, WIDE_N, HEAD_DIM, False, False, IEEE, UPCAST,
                                         KV_FP8=KV_FP8)
    for t in range(t_narrow, full_end, BLOCK_N):
        acc, l_i, m_i = attend_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row,
                                     k_head_off, v_head_off, t, kv_end, row_pos, qk_scale,
                                     stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                                     BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, False, IEEE, UPCAST,
                                     KV_FP8=KV_FP8)
    for t in range(full_end, kv_end, BLOCK_N):
        acc, l_i, m_i = attend_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row,
                                     k_head_off, v_head_off, t, kv_end, row_pos, qk_scale,
                                     stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                                     BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, True, IEEE, UPCAST,
                                     kv_lo, WINDOW, KV_FP8)
    if KV_FP8:
        acc = acc * v_scale
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # seq_len == 0 (padding): output 0
    o = acc / l_safe[:, None]
    optrs = (out_ptr + (q_start + r_tok[:, None]) * stride_ot + (head0 + r_head[:, None]) * stride_oh
             + offs_d[None, :])
    tl.store(optrs, o.to(out_ptr.dtype.element_ty), mask=rmask[:, None])
