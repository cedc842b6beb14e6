"""Triton kernels of paged attention: split-KV decode, mixed prefill/decode.
(New K/V are stored by the qkv epilogue kernel, `slipstream.ops.triton_qkv_epilogue`.)

Cache layout and batch semantics are those of `slipstream.ops.attention` (whose
pure-torch references are the oracle of everything here).

Kernels
-------
* Decode (`meta.max_query_len == 1`), "flash-decoding":
  `_decode_kernel`, grid (num_seqs, num_kv_heads, num_splits).  A program handles the
  query heads that share one KV head together (GQA packing: a [BLOCK_G >= 16, D] q tile,
  so scores and P·V are `tl.dot`s) over one contiguous chunk of its sequence.  The chunk
  length is computed in the kernel from the row's real seq_len,
      chunk = max(round_up(cdiv(seq_len, num_splits), BLOCK_N), MIN_CHUNK),
  so a CUDA graph captured for max_seq_len = max_model_len does little work for short
  rows: programs whose chunk starts past the end exit at once.  With one split the
  kernel writes the output directly; otherwise it writes a normalised partial output
  and its log-sum-exp (base 2) and `_decode_reduce_kernel` merges the splits.
* Prefill / mixed (`meta.max_query_len > 1`): `_prefill_kernel`, grid
  (num_tokens // BLOCK_Q + num_seqs, num_kv_heads).  Sequence s owns the program ids
  [query_start_loc[s] // BLOCK_Q + s, ...) (an increasing sequence whose total is bounded
  by the grid); a program finds its sequence by counting, loads a tile of BLOCK_Q query
  tokens x GROUP_P packed heads (BLOCK_M rows), and runs an online softmax over the
  paged KV up to its last row's causal position: first the tiles every row sees
  (no masks at all), then the few tiles on the diagonal (masked).

Everything is CUDA-graph safe: no host syncs; grids depend only on tensor shapes and the
host ints of the metadata.  Accumulation is float32; fp32 inputs use IEEE dot products.
Tokens after query_start_loc[-1] (if q has trailing padding) get zeros, like the
reference.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
NOMINAL_SM_COUNT = 132  # used when there is no GPU (interpreter runs)
_NEG_INIT = tl.constexpr(-1.0e30)  # finite running-max start: fully masked rows never make NaN


# ----------------------------------------------------------------------------- tunables

@dataclass(frozen=True)
class DecodeConfig:
    """Tunables of the decode (split-KV) path."""
    block_n: int = 64  # KV tokens per tile (any power of two >= 16; may span many blocks)
    num_warps: int = 4
    num_stages: int = 2  # measured best on the H200 (docs/kernel-notes.md, 2026-11-29)
    min_chunk: int = 256  # fewest KV tokens one split covers (rounded up to block_n)
    ctas_per_sm: int = 16  # split heuristic: aim at ~ctas_per_sm x SMs programs
    max_splits: int = 32
    # one split once num_seqs x kv_heads >= this x SMs (256 x 8 heads on 132 SMs: 1 split
    # ran at 103% of copy bandwidth against 95% with 2, docs/kernel-notes.md)
    full_occupancy_per_sm: int = 8
    num_splits: int | None = None  # force a split count (tests, tuning); None: heuristic


@dataclass(frozen=True)
class PrefillConfig:
    """Tunables of the prefill / mixed path."""
    block_m: int = 128  # q rows per program = query tokens x packed heads (power of two)
    block_n: int = 32  # KV tokens per tile (power of two >= 16); 32/4 warps/3 stages measured
    num_warps: int = 4  # best on the H200 (docs/kernel-notes.md, 2026-11-29)
    num_stages: int = 3


DEFAULT_DECODE_CONFIG = DecodeConfig()
DEFAULT_PREFILL_CONFIG = PrefillConfig()


def set_default_configs(decode: DecodeConfig | None = None,
                        prefill: PrefillConfig | None = None) -> None:
    """Change the configs used when a call passes none (e.g. after tuning)."""
    global DEFAULT_DECODE_CONFIG, DEFAULT_PREFILL_CONFIG
    if decode is not None:
        DEFAULT_DECODE_CONFIG = decode
    if prefill is not None:
        DEFAULT_PREFILL_CONFIG = prefill


_SM_COUNTS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return NOMINAL_SM_COUNT
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNTS:
        _SM_COUNTS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNTS[idx]


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                      cfg: DecodeConfig, sm_count: int) -> int:
    """Host-side split count: enough programs to fill the GPU, none shorter than
    min_chunk tokens.  Pure function of host ints (CUDA-graph safe)."""
    if cfg.num_splits is not None:
        return max(1, int(cfg.num_splits))
    programs = num_seqs * num_kv_heads
    if programs >= cfg.full_occupancy_per_sm * sm_count:
        return 1  # the batch alone fills the GPU: splitting only adds the merge pass
    min_chunk = max(cfg.min_chunk, cfg.block_n)
    by_len = triton.cdiv(max(max_seq_len, 1), min_chunk)
    by_occupancy = triton.cdiv(cfg.ctas_per_sm * sm_count, max(num_seqs * num_kv_heads, 1))
    return max(1, min(by_len, by_occupancy, cfg.max_splits))


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    # UPCAST: the interpreter cannot multiply bf16 (it multiplies the raw bits).
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _attend_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row_ptr, k_head_off, v_head_off,
                 t, kv_end, row_pos, qk_scale, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 MASK_END: tl.constexpr, CAUSAL: tl.constexpr,
                 IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """One online-softmax step over KV positions [t, t + BLOCK_N) of one sequence/KV head.

    MASK_END: positions >= kv_end are masked (else the whole tile must be valid).
    CAUSAL: position p is masked for a row whose absolute position row_pos < p.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    pos = t + offs_n
    if MASK_END:
        nmask = pos < kv_end
        blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE).to(tl.int64)
    in_blk = pos % BLOCK_SIZE
    k_rows = blk * stride_kcb + in_blk * stride_kcs + k_head_off
    v_rows = blk * stride_vcb + in_blk * stride_vcs + v_head_off
    k_ptrs = k_cache_ptr + (k_rows[:, None] + offs_d[None, :])
    v_ptrs = v_cache_ptr + (v_rows[:, None] + offs_d[None, :])
    if MASK_END:
        k = tl.load(k_ptrs, mask=nmask[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
    s = _dot(q, tl.trans(k), IEEE, UPCAST) * qk_scale
    if CAUSAL:
        keep = pos[None, :] <= row_pos[:, None]
        if MASK_END:
            keep = keep & nmask[None, :]
        s = tl.where(keep, s, float("-inf"))
    elif MASK_END:
        s = tl.where(nmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASK_END:
        v = tl.load(v_ptrs, mask=nmask[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE, UPCAST)
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
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                   qsl_ptr, seq_lens_ptr, bt_ptr, qk_scale, num_seqs, num_tokens,
                   stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                   stride_bt, stride_pos, stride_poh, stride_pok, stride_pls, stride_plh,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr,
                   SPLIT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    head0 = kvh * GROUP
    if seq == 0:
        if split == 0:
            _zero_tail(out_ptr, qsl_ptr, num_seqs, num_tokens, head0, stride_ot, stride_oh,
                       GROUP, BLOCK_G, HEAD_DIM)
    q_tok = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)
    if q_end <= q_tok:
        return  # no query token in this row
    seq_len = tl.load(seq_lens_ptr + seq)
    chunk = _chunk_len(seq_len, num_splits, BLOCK_N, MIN_CHUNK)
    start = split * chunk
    if SPLIT:
        if start >= seq_len:
            return  # past the end (the reduce ignores this split)
    end = tl.minimum(start + chunk, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    gmask = offs_g < GROUP
    q = tl.load(q_ptr + q_tok * stride_qt + (head0 + offs_g[:, None]) * stride_qh + offs_d[None, :],
                mask=gmask[:, None], other=0.0)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], _NEG_INIT, dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_head_off = kvh * stride_kch
    v_head_off = kvh * stride_vch
    full_end = start + ((end - start) // BLOCK_N) * BLOCK_N
    for t in range(start, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row,
                                     k_head_off, v_head_off, t, end, offs_g, qk_scale,
                                     stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                                     BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, False, IEEE, UPCAST)
    if full_end < end:
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row,
                                     k_head_off, v_head_off, full_end, end, offs_g, qk_scale,
                                     stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                                     BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, False, IEEE, UPCAST)
    if SPLIT:
        # start < seq_len here, so every row saw >= 1 valid position: l_i > 0.
        po = (part_out_ptr + seq.to(tl.int64) * stride_pos + (head0 + offs_g[:, None]) * stride_poh
              + split * stride_pok + offs_d[None, :])
        tl.store(po, acc / l_i[:, None], mask=gmask[:, None])
        pl = part_lse_ptr + seq * stride_pls + (head0 + offs_g) * stride_plh + split
        tl.store(pl, m_i + tl.log2(l_i), mask=gmask)
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # seq_len == 0: acc == 0 -> output 0
        o = acc / l_safe[:, None]
        optrs = out_ptr + q_tok * stride_ot + (head0 + offs_g[:, None]) * stride_oh + offs_d[None, :]
        tl.store(optrs, o.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


@triton.jit
def _decode_reduce_kernel(out_ptr, part_out_ptr, part_lse_ptr, qsl_ptr, seq_lens_ptr, num_splits,
                          stride_ot, stride_oh, stride_pos, stride_poh, stride_pok,
                          stride_pls, stride_plh,
                          HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
                          BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_tok = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)
    if q_end <= q_tok:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    chunk = _chunk_len(seq_len, num_splits, BLOCK_N, MIN_CHUNK)
    n_valid = tl.cdiv(seq_len, chunk)  # splits that ran (0 for a padding row)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    smask = offs_s < n_valid
    lse = tl.load(part_lse_ptr + seq * stride_pls + head * stride_plh + offs_s, mask=smask,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(n_valid > 0, m, 0.0)
    w = tl.where(smask, tl.exp2(lse - m), 0.0)
    denom = tl.sum(w, 0)
    denom = tl.where(denom > 0.0, denom, 1.0)
    po = tl.load(part_out_ptr + seq.to(tl.int64) * stride_pos + head * stride_poh
                 + offs_s[:, None] * stride_pok + offs_d[None, :], mask=smask[:, None], other=0.0)
    o = tl.sum(po * w[:, None], 0) / denom
    tl.store(out_ptr + q_tok * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, qsl_ptr, seq_lens_ptr, bt_ptr,
                    qk_scale, num_seqs, num_tokens,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                    stride_bt,
                    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_N: tl.constexpr, SEQ_CHUNK: tl.constexpr,
                    IEEE: tl.constexpr, UPCAST: tl.constexpr):
    # Reversed order: the longest (last) query tiles of the batch start first, the short
    # ones fill the tail.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    head0 = kvh * GROUP
    if tl.program_id(0) == 0:
        _zero_tail(out_ptr, qsl_ptr, num_seqs, num_tokens, head0, stride_ot, stride_oh,
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
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # absolute position of the sequence's first query token

    rows = tl.arange(0, BLOCK_M)
    r_tok = tok0 + rows // GROUP_P
    r_head = rows % GROUP_P
    rmask = (r_tok < q_len) & (r_head < GROUP)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_start + r_tok[:, None]) * stride_qt + (head0 + r_head[:, None]) * stride_qh
                + offs_d[None, :], mask=rmask[:, None], other=0.0)
    row_pos = ctx + r_tok

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_INIT, dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_head_off = kvh * stride_kch
    v_head_off = kvh * stride_vch
    # KV positions every row of the tile sees: [0, ctx + tok0]; the last row sees up to
    # ctx + tok0 + BLOCK_Q - 1 (clipped to the sequence).
    seen_by_all = tl.maximum(ctx + tok0 + 1, 0)
    kv_end = tl.minimum(seq_len, ctx + tok0 + BLOCK_Q)
    full_end = (seen_by_all // BLOCK_N) * BLOCK_N
    for t in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row,
                                     k_head_off, v_head_off, t, kv_end, row_pos, qk_scale,
                                     stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                                     BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, False, IEEE, UPCAST)
    for t in range(full_end, kv_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row,
                                     k_head_off, v_head_off, t, kv_end, row_pos, qk_scale,
                                     stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                                     BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, True, IEEE, UPCAST)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # seq_len == 0 (padding): output 0
    o = acc / l_safe[:, None]
    optrs = (out_ptr + (q_start + r_tok[:, None]) * stride_ot + (head0 + r_head[:, None]) * stride_oh
             + offs_d[None, :])
    tl.store(optrs, o.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


# ----------------------------------------------------------------------------- host side

def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "cache: [blocks, block_size, kv_heads, head_dim]"
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache head_dim must be contiguous"
    assert block_size >= 1 and block_size & (block_size - 1) == 0, "block_size must be a power of two"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "head_dim must be a power of two >= 16"
    return block_size, num_kv_heads, head_dim


def _dot_flags(dtype: torch.dtype, device: torch.device) -> tuple[bool, bool]:
    ieee = dtype == torch.float32
    upcast = device.type != "cuda" and dtype == torch.bfloat16
    return ieee, upcast


def effective_decode_config(cfg: DecodeConfig, dtype: torch.dtype, head_dim: int) -> DecodeConfig:
    """The config the decode kernel really runs with: legal tile sizes, and smaller tiles /
    more warps for fp32 (its IEEE dot products live in registers)."""
    block_n, num_warps = cfg.block_n, cfg.num_warps
    if dtype == torch.float32:
        block_n, num_warps = min(block_n, 32), max(num_warps, 8)
    block_n = max(16, triton.next_power_of_2(block_n))
    min_chunk = triton.cdiv(max(cfg.min_chunk, block_n), block_n) * block_n
    return replace(cfg, block_n=block_n, min_chunk=min_chunk, num_warps=num_warps)


def effective_prefill_config(cfg: PrefillConfig, dtype: torch.dtype, head_dim: int,
                             group: int) -> PrefillConfig:
    block_m, block_n, num_warps = cfg.block_m, cfg.block_n, cfg.num_warps
    if dtype == torch.float32:
        block_m, block_n, num_warps = min(block_m, 32), min(block_n, 32), max(num_warps, 8)
    elif head_dim > 128:
        block_m, block_n = min(block_m, 64), min(block_n, 32)
    block_m = max(triton.next_power_of_2(block_m), triton.next_power_of_2(group), 16)
    block_n = max(16, triton.next_power_of_2(block_n))
    return replace(cfg, block_m=block_m, block_n=block_n, num_warps=num_warps)


def decode_num_splits(meta, num_kv_heads: int, dtype: torch.dtype, head_dim: int,
                      device: torch.device, cfg: DecodeConfig | None = None) -> int:
    """The split count the decode path uses for this batch (for logs and benchmarks)."""
    cfg = effective_decode_config(cfg or DEFAULT_DECODE_CONFIG, dtype, head_dim)
    return choose_num_splits(meta.num_seqs, num_kv_heads, meta.max_seq_len, cfg, _sm_count(device))


def _decode(q, k_cache, v_cache, meta, scale, out, cfg: DecodeConfig) -> None:
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = meta.num_seqs
    block_g = max(16, triton.next_power_of_2(group))
    cfg = effective_decode_config(cfg, q.dtype, head_dim)
    num_splits = choose_num_splits(num_seqs, num_kv_heads, meta.max_seq_len, cfg, _sm_count(q.device))
    ieee, upcast = _dot_flags(q.dtype, q.device)
    split = num_splits > 1
    if split:
        part_out = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = out  # unused
        part_lse = out
    bt = meta.block_table
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse,
        meta.query_start_loc, meta.seq_lens, bt, scale * LOG2E, num_seqs, num_tokens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        bt.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2) if split else 0,
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=cfg.block_n, MIN_CHUNK=cfg.min_chunk, SPLIT=split, IEEE=ieee, UPCAST=upcast,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, meta.query_start_loc, meta.seq_lens, num_splits,
            out.stride(0), out.stride(1), part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_N=cfg.block_n, MIN_CHUNK=cfg.min_chunk, num_warps=4 if head_dim >= 128 else 2)


def _prefill(q, k_cache, v_cache, meta, scale, out, cfg: PrefillConfig) -> None:
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = meta.num_seqs
    group_p = triton.next_power_of_2(group)
    cfg = effective_prefill_config(cfg, q.dtype, head_dim, group)
    block_q = cfg.block_m // group_p
    ieee, upcast = _dot_flags(q.dtype, q.device)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    bt = meta.block_table
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, bt,
        scale * LOG2E, num_seqs, num_tokens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        bt.stride(0),
        GROUP=group, GROUP_P=group_p, BLOCK_M=cfg.block_m, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=cfg.block_n, SEQ_CHUNK=128, IEEE=ieee, UPCAST=upcast,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                           scale: float, out: torch.Tensor | None = None, *,
                           decode_config: DecodeConfig | None = None,
                           prefill_config: PrefillConfig | None = None,
                           num_splits: int | None = None) -> torch.Tensor:
    """Causal paged attention of q [num_tokens, num_heads, head_dim]; same result as
    `paged_attention_ref`.  Writes into `out` (same shape/dtype as q) if given.

    `num_splits` forces the decode split count (otherwise `decode_config.num_splits` or
    the heuristic `choose_num_splits`).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, hd = _check_cache(k_cache, v_cache)
    assert hd == head_dim and num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1, "q head_dim must be contiguous"
    assert k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, "q and cache dtypes differ"
    if out is None:
        out = torch.empty_like(q)
    else:
        assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if num_tokens == 0:
        return out
    if meta.num_seqs == 0:
        return out.zero_()
    if meta.max_query_len <= 1:
        cfg = decode_config or DEFAULT_DECODE_CONFIG
        if num_splits is not None:
            cfg = replace(cfg, num_splits=num_splits)
        _decode(q, k_cache, v_cache, meta, scale, out, cfg)
    else:
        _prefill(q, k_cache, v_cache, meta, scale, out, prefill_config or DEFAULT_PREFILL_CONFIG)
    return out


__all__ = ["DecodeConfig", "PrefillConfig", "set_default_configs", "choose_num_splits",
           "decode_num_splits", "effective_decode_config", "effective_prefill_config",
           "paged_attention_triton"]
