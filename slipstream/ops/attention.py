"""Paged attention: metadata, pure-torch references, and the device dispatch.

KV cache layout (one tensor each for K and V, per layer):
    [num_blocks, block_size, num_kv_heads, head_dim]
A token's cache slot is `block_id * block_size + offset`; `slot_mapping` gives it for
each new token (-1: padding, nothing stored).

A batch is a set of sequences, each contributing `query_len` consecutive new tokens
(query_start_loc is the prefix sum).  The new tokens are the *last* `query_len`
positions of a context of `seq_len` tokens whose K/V are all in the cache once the
new ones are stored, so query token i of a sequence sits at absolute position
`seq_len - query_len + i` and attends causally to positions <= that.
A row with seq_len == 0 is padding (CUDA-graph batches are padded): its output is 0.

FP8 cache (float8_e4m3fn K and V, `ops/kv_quant.py`): `kv_scales` are the layer's per-tensor
scales; the qkv epilogue stores k / k_scale and v / v_scale, and attention reads value x scale.

Sliding window (`window` W, a layer's; None: full attention): a query at position p attends
to the keys at positions (p - W, p], W keys with itself, as transformers masks it for
Mistral and Gemma 3 (`kv_idx > q_idx - sliding_window`).
"""
from __future__ import annotations

import torch

from slipstream.ops.fused import qkv_epilogue
from slipstream.ops.kv_quant import UNIT_SCALES, KVScales, dequantize_ref, is_fp8
from slipstream.ops.metadata import AttentionMetadata, QKVEpilogue


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, window: int | None = None,
                        kv_scales: KVScales | None = None) -> torch.Tensor:
    """Causal attention of q [num_tokens, num_heads, head_dim] over the paged cache.

    One sequence at a time, in float32: this is the oracle of the Triton kernels and
    the CPU path of the engine.  An FP8 cache is dequantized with `kv_scales` (1.0: None).
    """
    sc = kv_scales or UNIT_SCALES
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        q_start, q_end = starts[i], starts[i + 1]
        query_len = q_end - q_start
        if seq_len == 0 or query_len == 0:
            continue
        # keys from the first query's oldest one: blocks behind every window may be freed
        first = max(seq_len - query_len + 1 - window, 0) if window else 0
        first_block = first // block_size
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = meta.block_table[i, first_block:num_blocks].long()
        skip, span = first - first_block * block_size, seq_len - first
        k = dequantize_ref(k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[skip:skip + span], sc.k_scale)
        v = dequantize_ref(v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[skip:skip + span], sc.v_scale)
        k = k.repeat_interleave(group, dim=1)  # [span, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        qi = q[q_start:q_end].float()
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        k_pos = torch.arange(first, seq_len, device=q.device)
        masked = k_pos[None, :] > q_pos[:, None]
        if window:
            masked |= k_pos[None, :] <= q_pos[:, None] - window
        scores.masked_fill_(masked[None], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                    out: torch.Tensor | None = None, batch_invariant: bool = False,
                    window: int | None = None, kv_scales: KVScales | None = None) -> torch.Tensor:
    """Dispatch; writes into `out` (shape and dtype of q) when given, and returns it.
    `batch_invariant`: one kernel for every row, decode or prefill (see the Triton dispatch).
    `window`: the layer's sliding window (module doc), None for full attention.
    `kv_scales`: an FP8 cache's scales (module doc)."""
    if q.is_cuda:
        from slipstream.ops.triton_attention import paged_attention_triton
        return paged_attention_triton(q, k_cache, v_cache, meta, scale, out=out,
                                      batch_invariant=batch_invariant, window=window, kv_scales=kv_scales)
    result = paged_attention_ref(q, k_cache, v_cache, meta, scale, window, kv_scales)
    if out is None:
        return result
    out.copy_(result)
    return out


def attention_after_qkv(qkv: torch.Tensor, epi: QKVEpilogue, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, num_heads: int, num_kv_heads: int,
                        head_dim: int, batch_invariant: bool = False,
                        window: int | None = None, kv_scales: KVScales | None = None) -> torch.Tensor:
    """A layer's attention from its qkv GEMM's output: the qkv epilogue (q/k norm, RoPE, the
    new K/V into the cache), then paged attention; returns [T, num_heads, head_dim].

    On CUDA a small decode batch whose qkv is finished (one row on the GEMV) runs both in
    one kernel (the decode kernel with the epilogue inside:
    `triton_attention.epilogue_in_decode_applies`), else the epilogue kernel, then the
    attention kernels.  qkv's contents are consumed either way.
    `kv_scales`: an FP8 cache's per-tensor scales (ops/kv_quant.py; None: 1.0)."""
    if qkv.is_cuda and not batch_invariant:
        from slipstream.ops import triton_attention as ta
        if ta.epilogue_in_decode_applies(qkv, epi, k_cache, meta, num_heads):
            raw_q = qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
            return ta.paged_attention_triton(raw_q, k_cache, v_cache, meta, scale, epilogue=epi,
                                             window=window, kv_scales=kv_scales)
    q = qkv_epilogue(qkv, epi.positions, epi.cos_sin_cache, k_cache, v_cache, meta.slot_mapping,
                     num_heads, num_kv_heads, head_dim, q_norm_weight=epi.q_norm_weight,
                     k_norm_weight=epi.k_norm_weight, eps=epi.eps, hidden=epi.hidden, bias=epi.bias,
                     batch_invariant=batch_invariant, kv_scales=kv_scales)
    if q.is_cuda and q.dtype != k_cache.dtype and not is_fp8(k_cache):
        # Gemma 3's float32 q-norm leaves q in float32 over a bf16 cache: the kernels' dots
        # take one dtype, and q rounded once to the cache's is what transformers attends with
        q = q.to(k_cache.dtype)
    return paged_attention(q, k_cache, v_cache, meta, scale, batch_invariant=batch_invariant,
                           window=window, kv_scales=kv_scales)
