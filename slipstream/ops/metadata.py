"""What the attention kernels and their references read besides the tensors: a batch's
attention metadata and the qkv epilogue's inputs. One module the kernels, the references
and the model all import, so none of them imports another for a type."""
from __future__ import annotations

from dataclasses import dataclass

import torch


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
    # a verification step of speculative decoding (k + 1 = verify_len): every row has at most
    # verify_len query tokens, the newest positions of its context, and the split-KV verify
    # kernel (`triton_verify_kernel`) runs the batch; 0: not one
    verify_len: int = 0

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
