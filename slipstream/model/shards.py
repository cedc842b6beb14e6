"""Which slice of each checkpoint tensor a tensor-parallel rank keeps (Megatron layout).

q/k/v and gate/up are column-parallel (a slice of their output rows), o and down are
row-parallel (a slice of their input columns), the embedding and the LM head are
vocab-parallel (a slice of rows); norms and the o bias are whole on every rank. A MoE
layer's experts split the same way as the MLP (each expert's gate/up rows, down columns);
its router is whole on every rank.
"""
from __future__ import annotations

from typing import NamedTuple

from slipstream.model.parallel import TPShard


class Slice(NamedTuple):
    dim: int
    start: int
    length: int
    full: int  # the checkpoint tensor's size along `dim`


def shard_slice(hf_name: str, shard: TPShard | None) -> Slice | None:
    """The slice of checkpoint tensor `hf_name` that `shard`'s rank keeps; None: all of it."""
    if shard is None:
        return None
    c, d, r = shard.config, shard.config.head_dim, shard.rank
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        return Slice(0, shard.vocab_start, shard.vocab_rows(), c.vocab_size)
    if ".self_attn.q_proj." in hf_name:
        return Slice(0, r * shard.num_heads * d, shard.num_heads * d, c.q_size)
    if ".self_attn.k_proj." in hf_name or ".self_attn.v_proj." in hf_name:
        return Slice(0, shard.kv_head_start * d, shard.num_kv_heads * d, c.kv_size)
    if hf_name.endswith(".self_attn.o_proj.weight"):
        return Slice(1, r * shard.num_heads * d, shard.num_heads * d, c.q_size)
    if ".experts." in hf_name:  # one expert's projection (model/moe.py): its intermediate slice
        inter = shard.moe_intermediate_size
        dim = 1 if hf_name.endswith((".down_proj.weight", ".w2.weight")) else 0
        return Slice(dim, r * inter, inter, c.moe_intermediate_size)
    if ".mlp.gate_proj." in hf_name or ".mlp.up_proj." in hf_name:
        inter = shard.intermediate_size
        return Slice(0, r * inter, inter, c.intermediate_size)
    if hf_name.endswith(".mlp.down_proj.weight"):
        inter = shard.intermediate_size
        return Slice(1, r * inter, inter, c.intermediate_size)
    return None


def full_shape(local_shape: tuple[int, ...], s: Slice | None) -> tuple[int, ...]:
    """The checkpoint shape of a tensor whose rank-local shape is `local_shape`."""
    if s is None:
        return tuple(local_shape)
    shape = list(local_shape)
    shape[s.dim] = s.full
    return tuple(shape)


def take(t, s: Slice | None):
    """`t`'s slice `s` (a view), or `t`."""
    return t if s is None else t.narrow(s.dim, s.start, s.length)
