"""Paged attention on the GPU: launches of the Triton kernels in
`slipstream.ops.triton_attention_kernels` (their tunables and split heuristic:
`slipstream.ops.attention_tuning`).  (New K/V are stored by the qkv epilogue
kernel, `slipstream.ops.triton_qkv_epilogue`, or at one row by the decode kernel itself.)

Cache layout and batch semantics are those of `slipstream.ops.attention` (whose
pure-torch references are the oracle of everything here).

Kernels
-------
* Decode (`meta.max_query_len == 1`), "flash-decoding":
  `_decode_kernel`, one flat grid of num_seqs x num_kv_heads x num_splits programs
  (the split fastest, then the KV head, then the row).  A program handles the
  query heads that share one KV head together (GQA packing: a [BLOCK_G >= 16, D] q tile,
  so scores and P·V are `tl.dot`s) over one contiguous chunk of its sequence.  The chunk
  length is computed in the kernel from the row's real seq_len,
      chunk = max(round_up(cdiv(seq_len, num_splits), BLOCK_N), MIN_CHUNK),
  so a CUDA graph captured for max_seq_len = max_model_len does little work for short
  rows: programs whose chunk starts past the end exit at once.  Programs take rows in
  `meta.decode_order` (longest first) when the batch has one, so a ragged batch does not
  end on a long row.  With one split the kernel writes the output directly; otherwise each
  split writes a normalised partial output and its log-sum-exp (base 2), and the last split
  of a (row, KV head) to finish merges them (an atomic counter in `meta.split_counters`,
  reset by that program) -- or, without counters, `_decode_reduce_kernel` does.
  With `DecodeConfig.prefetch_batch` (8 by default) a batch of that many
  rows or fewer reads each program's row metadata and first KV tile, except the row's
  newest position, before waiting for the previous kernel (PDL, `ops/pdl.py`): the qkv
  epilogue before it is writing that position only, which is read after the wait.
  With `epilogue=` (a finished qkv row, at most `DecodeConfig.epilogue_batch` rows: one row
  on the GEMV today) the kernel does the qkv epilogue itself: each program rotates its q
  heads from qkv's raw q columns, and the program whose split holds a row's newest position
  stores that position's K/V before its own tile loads read it (`decode_epilogue`).
* Verification (`meta.verify_len` = k + 1 > 0, speculative decoding): `_verify_kernel`
  (`triton_verify_kernel`), the decode kernel's grid and split merge with up to k + 1
  query tokens a row packed into the M dimension beside the group's heads, so they share
  each K/V tile; a causal mask over the row's newest positions.
* Mixed batches with `meta.num_decode > 0`: the decode kernel takes the first num_decode
  rows of `meta.decode_order`, where the single-token rows come first, and skips any that
  has not exactly one query token (`SINGLE_ONLY`: a mixed CUDA graph covers every row);
  the prefill kernel skips the single-token rows (`SKIP_SINGLE`).
* Prefill / mixed (`meta.max_query_len > 1`): `_prefill_kernel`, grid
  (num_tokens // BLOCK_Q + num_seqs, num_kv_heads).  Sequence s owns the program ids
  [query_start_loc[s] // BLOCK_Q + s, ...) (an increasing sequence whose total is bounded
  by the grid); a program finds its sequence by counting, loads a tile of BLOCK_Q query
  tokens x GROUP_P packed heads (BLOCK_M rows), and runs an online softmax over the
  paged KV up to its last row's causal position: first the tiles every row sees
  (no masks at all), then the few tiles on the diagonal (masked).  With
  `batch_invariant=True` decode batches run here too (see `paged_attention_triton`).

Sliding window (`window`, a layer's): a constexpr of both kernels (WINDOW; 0, the default,
compiles the full-attention kernels as they were).  A decode row splits its last `window`
positions only; a prefill tile starts at its first row's oldest key, masking the tiles
where some row's window begins, and reads no position below that key (its block may have
been freed: sched/scheduler.py frees blocks behind every window early).

FP8 cache (float8_e4m3fn K and V, `kv_scales`: the layer's per-tensor scales,
`ops/kv_quant.py`): the KV_FP8 constexpr of both kernels; tiles are upcast to float16 as
they are loaded (float32 for a float32 q; a bf16 q is cast to float16:
`triton_attention_kernels`' doc), k_scale is folded into the softmax scale and v_scale into
the output.
Launches for a cache of q's dtype pass no FP8 argument and compile as they did.

Everything is CUDA-graph safe: no host syncs; grids depend only on tensor shapes and the
host ints of the metadata.  Accumulation is float32; fp32 inputs use IEEE dot products.
Tokens after query_start_loc[-1] (if q has trailing padding) get zeros, like the
reference.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton

from slipstream.ops.kv_quant import UNIT_SCALES, KVScales, is_fp8
from slipstream.ops.metadata import QKVEpilogue
from slipstream.ops.device import dot_flags, sm_count
from slipstream.ops.pdl import pdl_launch
from slipstream.ops.attention_tuning import (DEFAULT_DECODE_CONFIG, DEFAULT_PREFILL_CONFIG, DecodeConfig,
                                             DecodeSplitPolicy, PrefillConfig, choose_num_splits,
                                             decode_split_options, effective_decode_config,
                                             effective_prefill_config, pick_decode_splits)
from slipstream.ops.triton_attention_kernels import _decode_kernel, _decode_reduce_kernel
from slipstream.ops.triton_prefill_kernel import _prefill_kernel
from slipstream.ops.triton_verify_kernel import _verify_kernel, _verify_reduce_kernel

LOG2E = 1.4426950408889634


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "cache: [blocks, block_size, kv_heads, head_dim]"
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache head_dim must be contiguous"
    assert block_size >= 1 and block_size & (block_size - 1) == 0, "block_size must be a power of two"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "head_dim must be a power of two >= 16"
    return block_size, num_kv_heads, head_dim


def decode_num_splits(meta, num_kv_heads: int, dtype: torch.dtype, head_dim: int,
                      device: torch.device, cfg: DecodeConfig | None = None) -> int:
    """The split count the decode path uses for this batch (for logs and benchmarks)."""
    cfg = effective_decode_config(cfg or DEFAULT_DECODE_CONFIG, dtype, head_dim)
    return choose_num_splits(meta.num_seqs, num_kv_heads, meta.max_seq_len, cfg, sm_count(device))


def decode_attention(q, k_cache, v_cache, meta, scale: float, out: torch.Tensor,
                     config: DecodeConfig | None = None, *, num_rows: int | None = None,
                     epilogue: QKVEpilogue | None = None, window: int | None = None,
                     kv_scales: KVScales | None = None) -> None:
    """The decode (split-KV) kernel alone, into `out`: over all rows, or over the `num_rows`
    first rows of meta.decode_order (the single-token rows of a mixed batch; needs
    meta.split_counters).  `paged_attention_triton` picks this or `prefill_attention` (or
    both for a mixed batch); benchmarks call them directly to time one kernel.
    epilogue: q is the unrotated q columns of the qkv GEMM's output ([T, Hq, D] view of
    qkv), and the kernel does the qkv epilogue's work itself (`attention_after_qkv`, which
    checks `epilogue_in_decode_applies`).  kv_scales: an FP8 cache's scales (None: 1.0)."""
    cfg = config or DEFAULT_DECODE_CONFIG
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = meta.num_seqs
    subset = num_rows is not None
    num_rows = num_rows if subset else num_seqs
    block_g = max(16, triton.next_power_of_2(group))
    cfg = effective_decode_config(cfg, q.dtype, head_dim, num_rows)
    span = min(meta.max_seq_len, window) if window else meta.max_seq_len
    num_splits = choose_num_splits(num_rows, num_kv_heads, span, cfg, sm_count(q.device))
    ieee, upcast = dot_flags(q.dtype, q.device)
    split = num_splits > 1
    order = meta.decode_order if cfg.longest_first or subset else None
    counters = meta.split_counters if cfg.fused_merge or subset else None
    # The in-kernel merge is used with a row order only: merge without one measured 25-30%
    # slower at 32 x 4096-8192 on the H200 (benchmarks/notes/kernel-notes.md, v4), the reduce pass not.
    merge = split and counters is not None and order is not None
    if merge:
        assert counters.dtype == torch.int32 and counters.numel() >= num_seqs * num_kv_heads, \
            "split_counters: int32, zero, >= num_seqs x num_kv_heads"
    if split:
        part_out = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = out  # unused
        part_lse = out
    bt = meta.block_table
    pdl = pdl_launch(q.device)
    _decode_kernel[(num_rows * num_kv_heads * num_splits,)](
        q, k_cache, v_cache, out, part_out, part_lse,
        meta.query_start_loc, meta.seq_lens, bt, order if order is not None else meta.seq_lens,
        counters if merge else meta.seq_lens, _qk_scale(scale, k_cache, kv_scales), num_seqs, num_tokens,
        num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        bt.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2) if split else 0,
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=cfg.block_n, MIN_CHUNK=cfg.min_chunk, SPLIT=split, HAS_ORDER=order is not None,
        MERGE=merge, SINGLE_ONLY=subset, NUM_KV_HEADS=num_kv_heads, IEEE=ieee, UPCAST=upcast,
        PREFETCH=0 < num_rows <= cfg.prefetch_batch, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl, **_epilogue_args(epilogue, q, meta), **_window_arg(window),
        **_fp8_args(k_cache, kv_scales, epilogue is not None))
    if split and not merge:
        assert not subset, "a row subset needs split_counters (the reduce pass runs over every row)"
        _decode_reduce_kernel[(num_seqs, num_kv_heads)](
            out, part_out, part_lse, meta.query_start_loc, meta.seq_lens, num_splits,
            out.stride(0), out.stride(1), part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_N=cfg.block_n,
            MIN_CHUNK=cfg.min_chunk, num_warps=4, **pdl, **_window_arg(window))


def verify_attention(q, k_cache, v_cache, meta, scale: float, out: torch.Tensor,
                     config: DecodeConfig | None = None, *, window: int | None = None,
                     kv_scales: KVScales | None = None) -> None:
    """The split-KV verify kernel (`triton_verify_kernel`) into `out`: every row has at most
    meta.verify_len query tokens (the verification step of speculative decoding).  The split
    count follows the decode heuristic over the rows (the step reads each context once)."""
    cfg = config or DEFAULT_DECODE_CONFIG
    q_len = meta.verify_len
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = meta.num_seqs
    block_m = max(16, triton.next_power_of_2(q_len * group))
    cfg = effective_decode_config(cfg, q.dtype, head_dim, num_seqs)
    span = min(meta.max_seq_len, window + q_len - 1) if window else meta.max_seq_len
    num_splits = choose_num_splits(num_seqs, num_kv_heads, span, cfg, sm_count(q.device))
    ieee, upcast = dot_flags(q.dtype, q.device)
    split = num_splits > 1
    order = meta.decode_order if cfg.longest_first else None
    counters = meta.split_counters if cfg.fused_merge else None
    merge = split and counters is not None and order is not None
    if split:  # partials per query token
        part_out = torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    bt = meta.block_table
    pdl = pdl_launch(q.device)
    consts = dict(GROUP=group, Q_LEN=q_len, BLOCK_M=block_m, HEAD_DIM=head_dim, BLOCK_N=cfg.block_n,
                  MIN_CHUNK=cfg.min_chunk, **_window_arg(window))
    _verify_kernel[(num_seqs * num_kv_heads * num_splits,)](
        q, k_cache, v_cache, out, part_out, part_lse,
        meta.query_start_loc, meta.seq_lens, bt, order if order is not None else meta.seq_lens,
        counters if merge else meta.seq_lens, _qk_scale(scale, k_cache, kv_scales), num_seqs, num_tokens,
        num_splits, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), bt.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2) if split else 0,
        part_lse.stride(0), part_lse.stride(1),
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size, SPLIT=split,
        HAS_ORDER=order is not None, MERGE=merge, NUM_KV_HEADS=num_kv_heads, IEEE=ieee, UPCAST=upcast,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **consts, **pdl,
        **_fp8_args(k_cache, kv_scales))
    if split and not merge:
        _verify_reduce_kernel[(num_seqs, num_kv_heads)](
            out, part_out, part_lse, meta.query_start_loc, meta.seq_lens, num_splits,
            out.stride(0), out.stride(1), part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1), num_warps=4, **consts, **pdl)


def _qk_scale(scale: float, k_cache: torch.Tensor, kv_scales: KVScales | None) -> float:
    """The kernels' softmax scale in base 2, with an FP8 cache's k_scale folded in."""
    if is_fp8(k_cache):
        scale = scale * (kv_scales or UNIT_SCALES).k_scale
    return scale * LOG2E


def _fp8_args(k_cache: torch.Tensor, kv_scales: KVScales | None, stores: bool = False) -> dict:
    """The kernels' FP8 arguments (`stores`: the decode kernel's epilogue stores the newest
    K/V too); none for a cache of q's dtype, so those launches stay as they were."""
    if not is_fp8(k_cache):
        return {}
    sc = kv_scales or UNIT_SCALES
    args = {"v_scale": sc.v_scale, "KV_FP8": True}
    if stores:
        args.update(k_inv_scale=sc.inv_k, v_inv_scale=sc.inv_v)
    return args


def _window_arg(window: int | None) -> dict:
    """The kernels' WINDOW argument; none without a window, so those launches stay as they were."""
    return {"WINDOW": int(window)} if window else {}


def _epilogue_args(epi: QKVEpilogue | None, q: torch.Tensor, meta) -> dict:
    """The decode kernel's epilogue arguments (none without one).  Absent norm weights are
    passed as q (never read: their constexpr switches are off)."""
    if epi is None:
        return {}
    if epi.hidden is not None or epi.bias is not None:
        raise ValueError("the qkv epilogue inside the decode kernel takes a finished qkv "
                         "(no row scale or bias left to apply)")
    cs = epi.cos_sin_cache if epi.cos_sin_cache.stride(-1) == 1 else epi.cos_sin_cache.contiguous()
    return dict(
        pos_ptr=epi.positions, cs_ptr=cs, slot_ptr=meta.slot_mapping,
        qw_ptr=q if epi.q_norm_weight is None else epi.q_norm_weight,
        kw_ptr=q if epi.k_norm_weight is None else epi.k_norm_weight,
        stride_cs=cs.stride(0), eps=float(epi.eps), EPILOGUE=True,
        Q_NORM=epi.q_norm_weight is not None, K_NORM=epi.k_norm_weight is not None,
        # no FMA contraction, as the qkv epilogue kernel is compiled: q and the stored K/V are
        # that kernel's
        enable_fp_fusion=False)


def epilogue_in_decode_applies(qkv: torch.Tensor, epi: QKVEpilogue, k_cache: torch.Tensor, meta,
                               num_heads: int, config: DecodeConfig | None = None) -> bool:
    """Whether `attention_after_qkv` runs the qkv epilogue inside the decode kernel: a
    decode batch (one token a row, every token in a row) of at most
    `DecodeConfig.epilogue_batch` rows whose qkv is finished (the one-row GEMV applied the
    folded norm's row scale and the bias: `ops/linear.py`), and whose q/k norms and cache
    keep qkv's dtype (the epilogue kernel's float32-intermediate variants stay separate; an
    FP8 cache is stored quantized, as that kernel does).
    An unfinished qkv stays with the epilogue kernel: a first version that applied the row
    scale in every decode program made seed-8b-bs8 2.3% slower (4.71 -> 4.82 ms a step
    on the H200; benchmarks/notes/kernel-notes.md)."""
    cfg = config or DEFAULT_DECODE_CONFIG
    rows = meta.num_seqs
    if not (meta.max_query_len <= 1 and 0 < rows <= cfg.epilogue_batch and qkv.shape[0] == rows
            and epi.hidden is None and epi.bias is None):
        return False
    same = [torch.promote_types(w.dtype, qkv.dtype) == qkv.dtype
            for w in (epi.q_norm_weight, epi.k_norm_weight) if w is not None]
    head_dim = k_cache.shape[-1]
    return all(same) and (k_cache.dtype == qkv.dtype or is_fp8(k_cache)) \
        and qkv.shape[1] == (num_heads + 2 * k_cache.shape[2]) * head_dim


def prefill_attention(q, k_cache, v_cache, meta, scale: float, out: torch.Tensor,
                      config: PrefillConfig | None = None, *, skip_single: bool = False,
                      window: int | None = None, kv_scales: KVScales | None = None) -> None:
    """The prefill kernel alone, into `out`, over every row (`skip_single`: but those with
    one query token, which a mixed batch gives to `decode_attention`)."""
    cfg = config or DEFAULT_PREFILL_CONFIG
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = meta.num_seqs
    group_p = triton.next_power_of_2(group)
    cfg = effective_prefill_config(cfg, q.dtype, head_dim, group)
    block_q = cfg.block_m // group_p
    ieee, upcast = dot_flags(q.dtype, q.device)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    bt = meta.block_table
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, bt,
        _qk_scale(scale, k_cache, kv_scales), num_seqs, num_tokens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        bt.stride(0),
        GROUP=group, GROUP_P=group_p, BLOCK_M=cfg.block_m, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=cfg.block_n, WIDE_N=cfg.wide_n, SEQ_CHUNK=128, SKIP_SINGLE=skip_single,
        IEEE=ieee, UPCAST=upcast, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_launch(q.device), **_window_arg(window), **_fp8_args(k_cache, kv_scales))


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                           scale: float, out: torch.Tensor | None = None, *,
                           decode_config: DecodeConfig | None = None,
                           prefill_config: PrefillConfig | None = None,
                           num_splits: int | None = None,
                           batch_invariant: bool = False,
                           epilogue: QKVEpilogue | None = None,
                           window: int | None = None,
                           kv_scales: KVScales | None = None) -> torch.Tensor:
    """Causal paged attention of q [num_tokens, num_heads, head_dim]; same result as
    `paged_attention_ref`.  Writes into `out` (same shape/dtype as q) if given.

    `num_splits` forces the decode split count (otherwise `meta.num_splits`, then
    `decode_config.num_splits`, then the heuristic `choose_num_splits`).
    `batch_invariant` sends decode batches to the prefill kernel too: its result for a query token depends only on that token's q and
    context (KV tiles from position 0, fixed order), not on the batch, the split count or
    the chunking of a prompt.
    `epilogue`: q is the qkv GEMM's unrotated q columns and the decode kernel does the qkv
    epilogue's work too (decode batches only: `epilogue_in_decode_applies`).
    `window`: the layer's sliding window (ops/attention.py), None for full attention.
    `kv_scales`: the per-tensor scales of an FP8 cache (None: 1.0; module doc).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, hd = _check_cache(k_cache, v_cache)
    assert hd == head_dim and num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1, "q head_dim must be contiguous"
    assert k_cache.dtype == v_cache.dtype and (k_cache.dtype == q.dtype or is_fp8(k_cache)), \
        "the cache's dtype is neither q's nor float8_e4m3fn"
    if out is None:
        out = torch.empty_like(q)
    else:
        assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if num_tokens == 0:
        return out
    if meta.num_seqs == 0:
        return out.zero_()
    decode_cfg = decode_config or DEFAULT_DECODE_CONFIG
    num_splits = num_splits if num_splits is not None else meta.num_splits
    if num_splits is not None:
        decode_cfg = replace(decode_cfg, num_splits=num_splits)
    prefill_cfg = prefill_config or DEFAULT_PREFILL_CONFIG
    if batch_invariant:  # every token's tiles from position 0 at one width: no wide tiles
        prefill_cfg = replace(prefill_cfg, wide_n=0)
    if epilogue is not None and (meta.max_query_len > 1 or batch_invariant):
        raise ValueError("the qkv epilogue runs inside the decode kernel only: a decode batch, "
                         "not batch-invariant")
    per_layer = {"window": window} if window else {}  # the layer's window and FP8 scales
    if is_fp8(k_cache):
        per_layer["kv_scales"] = kv_scales
    if meta.verify_len and not batch_invariant:
        verify_attention(q, k_cache, v_cache, meta, scale, out, decode_cfg, **per_layer)
    elif meta.max_query_len <= 1 and not batch_invariant:
        decode_attention(q, k_cache, v_cache, meta, scale, out, decode_cfg, epilogue=epilogue, **per_layer)
    elif meta.num_decode and not batch_invariant and meta.decode_order is not None \
            and meta.split_counters is not None:
        # a mixed batch: its single-token rows read their whole context, which the split-KV
        # decode kernel streams at full bandwidth; the prefill kernel would give each one
        # program per KV head
        prefill_attention(q, k_cache, v_cache, meta, scale, out, prefill_cfg, skip_single=True, **per_layer)
        decode_attention(q, k_cache, v_cache, meta, scale, out, decode_cfg, num_rows=meta.num_decode,
                         **per_layer)
    else:
        prefill_attention(q, k_cache, v_cache, meta, scale, out, prefill_cfg, **per_layer)
    return out


__all__ = ["DecodeConfig", "PrefillConfig", "choose_num_splits",
           "decode_split_options", "pick_decode_splits", "DecodeSplitPolicy", "decode_num_splits",
           "effective_decode_config", "effective_prefill_config", "decode_attention", "prefill_attention",
           "verify_attention",
           "epilogue_in_decode_applies",
           "paged_attention_triton"]
