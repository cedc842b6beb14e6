"""Tensor parallelism: how a model splits over ranks, and the collectives between them.

`TPShard` is the arithmetic (Megatron layout): query heads, intermediate columns and the
vocabulary split evenly over ranks; KV heads split too, or, when there are fewer KV heads
than ranks, each is replicated on `tp / num_kv_heads` consecutive ranks (the ranks whose
query heads read it).  `TPGroup` wraps the torch.distributed group (NCCL on CUDA, gloo on
the CPU) with the two collectives the decoder uses: an in-place all-reduce (after
attention, after the MLP, after the vocab-parallel embedding) and the all-gather of
vocab-parallel logits.  With one rank there is no group and no model code calls either.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from slipstream.model.config import ModelConfig

# A collective waits this long for its peers before it raises (gloo) or its NCCL watchdog
# ends the process; a dead peer is seen sooner by the executor's process monitoring.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("SLIPSTREAM_TP_TIMEOUT_S", "60"))
# setup waits longer: the ranks start (import torch, load weights, compile) unevenly
JOIN_TIMEOUT_S = max(COLLECTIVE_TIMEOUT_S, 600.0)
# NVLink multicast (NVLS) is off on the machines we run on (KINDS.md)
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
    """A one-line ValueError when `config`'s head counts (or MLP width) do not split over tp ranks."""
    if tp <= 1:
        return
    heads, kv = config.num_heads, config.num_kv_heads
    if heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's num_attention_heads={heads}")
    if kv % tp and tp % kv:
        raise ValueError(f"tensor_parallel_size={tp} and the model's num_key_value_heads={kv}: "
                         f"neither divides the other, so the KV heads can be neither split nor replicated")
    name, width = (("moe_intermediate_size", config.moe_intermediate_size) if config.is_moe
                   else ("intermediate_size", config.intermediate_size))
    if width % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {name}={width}")


@dataclass(frozen=True)
class TPShard:
    """What rank `rank` of `size` holds of a model."""
    rank: int
    size: int
    config: ModelConfig

    @property
    def num_heads(self) -> int:
        return self.config.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(self.config.num_kv_heads // self.size, 1)

    @property
    def kv_head_start(self) -> int:
        kv = self.config.num_kv_heads
        if kv >= self.size:
            return self.rank * self.num_kv_heads
        return self.rank // (self.size // kv)  # replicated: the head this rank's queries read

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.size

    @property
    def moe_intermediate_size(self) -> int:
        """Each expert's intermediate columns on this rank (model/moe.py)."""
        return self.config.moe_intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.config.vocab_size // self.size)  # the last rank's rows may be padding

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def vocab_rows(self) -> int:
        """The real (not padding) vocabulary rows of this rank."""
        return max(0, min(self.vocab_per_rank, self.config.vocab_size - self.vocab_start))


class TPGroup:
    """This process's rank in the tensor-parallel group, and its collectives."""

    def __init__(self, shard: TPShard, group) -> None:
        self.shard = shard
        self.rank, self.size = shard.rank, shard.size
        self.group = group

    def serving(self) -> None:
        """Setup is over: from now on a collective waits COLLECTIVE_TIMEOUT_S at most."""
        torch.distributed.distributed_c10d._set_pg_timeout(
            datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S), self.group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(t, group=self.group)
        return t

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """[N, vocab] logits from each rank's [N, vocab_per_rank] slice (padding columns cut)."""
        n, per = local.shape
        out = torch.empty((self.size * n, per), dtype=local.dtype, device=local.device)
        _all_gather(out, local.contiguous(), group=self.group)
        logits = out.view(self.size, n, per).permute(1, 0, 2).reshape(n, self.size * per)
        vocab = self.shard.config.vocab_size
        return logits if logits.shape[1] == vocab else logits[:, :vocab].contiguous()


# torch 2.13 renamed all_gather_into_tensor (the old name warns)
_all_gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor


def init_tp_group(shard: TPShard, init_method: str, device: torch.device) -> TPGroup:
    """Join the group (every rank calls this; collectives wait JOIN_TIMEOUT_S until `serving`);
    NCCL binds the rank's device eagerly."""
    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=JOIN_TIMEOUT_S)
    if device.type == "cuda":
        dist.init_process_group("nccl", init_method=init_method, rank=shard.rank, world_size=shard.size,
                                timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=shard.rank, world_size=shard.size,
                                timeout=timeout)
    return TPGroup(shard, dist.group.WORLD)
