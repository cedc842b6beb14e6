"""Paged attention: metadata, pure-torch references, and the device dispatch.

(`store_kv_ref` is the oracle of the KV store that `slipstream.ops.fused.qkv_epilogue`
fuses with the q/k norm and RoPE.)

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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.ops.fused import qkv_epilogue


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]; 0 marks a padding row
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    slot_mapping: torch.Tensor  # int32 [num_tokens]; -1 = do not store
    max_query_len: int  # host-side bound; 1 means a decode-only batch
    max_seq_len: int  # host-side bound on seq_lens (graphs pass the model's max length)
    # optional, decode kernel only: rows by decreasing seq_len (int32 [num_seqs], a
    # permutation), and int32 zeros >= num_seqs x num_kv_heads that the split merge counts
    # in (it leaves them zero again)
    decode_order: torch.Tensor | None = None
    split_counters: torch.Tensor | None = None
    # mixed batches (max_query_len > 1): when > 0, decode_order[:num_decode] lists the rows
    # with one query token (longest first); the split-KV decode kernel takes those rows and
    # the prefill kernel the others
    num_decode: int = 0
    # the decode kernel's split count, chosen by the caller from the batch's context
    # lengths (the runner: `triton_attention.pick_decode_splits`); None: the heuristic
    num_splits: int | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass(frozen=True)
class QKVEpilogue:
    """What the qkv epilogue (`slipstream.ops.fused.qkv_epilogue`) needs besides qkv, the
    caches and the slots (meta.slot_mapping): the rotary inputs, Qwen3's q/k norm weights, and
    for an unfinished GEMM output the residual stream it read (folded norm) and the bias."""
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    q_norm_weight: torch.Tensor | None = None
    k_norm_weight: torch.Tensor | None = None
    eps: float = 1e-6
    hidden: torch.Tensor | None = None
    bias: torch.Tensor | None = None


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into their cache slots."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v[keep].to(v_cache.dtype)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of q [num_tokens, num_heads, head_dim] over the paged cache.

    One sequence at a time, in float32: this is the oracle of the Triton kernels and
    the CPU path of the engine.
    """
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
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = meta.block_table[i, :num_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        qi = q[q_start:q_end].float()
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                    out: torch.Tensor | None = None, batch_invariant: bool = False) -> torch.Tensor:
    """Dispatch; writes into `out` (shape and dtype of q) when given, and returns it.
    `batch_invariant`: one kernel for every row, decode or prefill (see the Triton dispatch)."""
    if q.is_cuda:
        from slipstream.ops.triton_attention import paged_attention_triton
        return paged_attention_triton(q, k_cache, v_cache, meta, scale, out=out,
                                      batch_invariant=batch_invariant)
    result = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    if out is None:
        return result
    out.copy_(result)
    return out


def attention_after_qkv(qkv: torch.Tensor, epi: QKVEpilogue, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, num_heads: int, num_kv_heads: int,
                        head_dim: int, batch_invariant: bool = False) -> torch.Tensor:
    """A layer's attention from its qkv GEMM's output: the qkv epilogue (q/k norm, RoPE, the
    new K/V into the cache), then paged attention; returns [T, num_heads, head_dim].

    On CUDA a small decode batch whose qkv is finished (one row on the GEMV) runs both in
    one kernel (the decode kernel with the epilogue inside:
    `triton_attention.epilogue_in_decode_applies`), else the epilogue kernel, then the
    attention kernels.  qkv's contents are consumed either way."""
    if qkv.is_cuda and not batch_invariant:
        from slipstream.ops import triton_attention as ta
        if ta.epilogue_in_decode_applies(qkv, epi, k_cache, meta, num_heads):
            raw_q = qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
            return ta.paged_attention_triton(raw_q, k_cache, v_cache, meta, scale, epilogue=epi)
    q = qkv_epilogue(qkv, epi.positions, epi.cos_sin_cache, k_cache, v_cache, meta.slot_mapping,
                     num_heads, num_kv_heads, head_dim, q_norm_weight=epi.q_norm_weight,
                     k_norm_weight=epi.k_norm_weight, eps=epi.eps, hidden=epi.hidden, bias=epi.bias,
                     batch_invariant=batch_invariant)
    return paged_attention(q, k_cache, v_cache, meta, scale, batch_invariant=batch_invariant)
