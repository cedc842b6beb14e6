"""Sizing and allocating the paged KV cache.

On CUDA the pool takes what is left of this engine's share (`gpu_memory_utilization` x total
memory, the memory other processes held at its start not counted against it) after
the weights and the peak of a profiling step (the largest prefill the scheduler may
build, plus sampling at max_num_seqs rows) and a reserve for the CUDA-graph pool (whose
mixed-step graphs keep the activations of the largest one: that step's activations again).
On the CPU it takes a fixed budget.  Never more than max_num_seqs full-length sequences.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.ops.metadata import AttentionMetadata
from slipstream.runner.graphs import mixed_graph_tokens
from slipstream.sampling.sampler import SamplerFlags, SamplingTensors, sample

GiB = 1 << 30


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [(torch.zeros(shape, dtype=spec.dtype, device=device),
             torch.zeros(shape, dtype=spec.dtype, device=device)) for _ in range(spec.num_layers)]


def num_kv_blocks(runner, spec: KVCacheSpec, opts) -> int:
    if opts.num_kv_blocks is not None:
        return opts.num_kv_blocks
    if runner.device.type != "cuda":
        budget = opts.cpu_kv_cache_gib * GiB
        return blocks_that_fit(budget, spec, opts, f"cpu_kv_cache_gib={opts.cpu_kv_cache_gib} leaves")
    base = torch.cuda.memory_allocated(runner.device)
    peak = _profile_peak(runner, spec, opts)
    free, total = torch.cuda.mem_get_info(runner.device)
    vocab = runner.model_config.vocab_size
    graph_reserve = 0
    if opts.use_cuda_graphs:
        graph_reserve = opts.cuda_graph_max_batch * vocab * 4 * 6 + GiB // 2
        if mixed_graph_tokens(opts):
            graph_reserve += peak - base
    available = kv_budget(total, free, torch.cuda.memory_reserved(runner.device), opts.cuda_used_at_start,
                          opts.gpu_memory_utilization, peak, graph_reserve)
    return blocks_that_fit(available, spec, opts,
                           f"after the weights and activations ({_gib(peak)} at peak), "
                           f"gpu_memory_utilization={opts.gpu_memory_utilization} of {_gib(total)} leaves")


def gpu_memory_in_use(device: torch.device) -> int:
    """Bytes of the GPU in use before this engine allocates any (other processes: replicas
    sharing the GPU, and this process's CUDA context); 0 off CUDA."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def kv_budget(total: int, free: int, reserved: int, used_at_start: int, utilization: float,
              peak: int, graph_reserve: int) -> float:
    """Bytes for the KV cache. `utilization` x total is this engine's share of the GPU (as in
    vLLM: two replicas at 0.45 share one GPU), never more than what was free at its start;
    from it go this process's memory outside torch (what is in use beyond torch's reserve
    and the memory in use at start), the profiled peak and the CUDA-graph reserve."""
    not_torch = max(total - free - reserved - used_at_start, 0)
    share = min(total * utilization, total - used_at_start)
    return share - not_torch - peak - graph_reserve


def blocks_that_fit(available: float, spec: KVCacheSpec, opts, what_leaves: str) -> int:
    """KV blocks in `available` bytes, at most max_num_seqs full-length sequences; an error
    naming the fix when not even one sequence of max_model_len fits."""
    per_seq = -(-opts.max_model_len // opts.block_size)
    blocks = int(max(available, 0) // spec.bytes_per_block)
    if blocks < per_seq:
        raise RuntimeError(
            f"the model does not fit: {what_leaves} {_gib(max(available, 0))} for the KV cache, but one "
            f"sequence of max_model_len={opts.max_model_len} needs {_gib(per_seq * spec.bytes_per_block)}; "
            f"lower max_model_len (or max_num_batched_tokens / max_num_seqs), or give the KV cache more memory")
    return min(blocks, per_seq * opts.max_num_seqs)


def _profile_peak(runner, spec: KVCacheSpec, opts) -> int:
    """Peak bytes of the largest eager step, measured with a throw-away KV cache."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    tokens = opts.max_num_batched_tokens
    seq_len = min(tokens, opts.max_model_len)
    num_seqs = -(-tokens // seq_len)
    lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    blocks_per_seq = -(-seq_len // spec.block_size)
    caches = allocate_kv_caches(spec, blocks_per_seq * num_seqs, device)
    qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
    table = torch.arange(blocks_per_seq * num_seqs, dtype=torch.int32, device=device).view(num_seqs, -1)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device=device, dtype=torch.int32)
    slots = torch.cat([i * blocks_per_seq * spec.block_size + torch.arange(n) for i, n in enumerate(lens)])
    slots = slots.to(device=device, dtype=torch.int32)
    meta = AttentionMetadata(qsl, torch.tensor(lens, dtype=torch.int32, device=device), table, slots,
                             max(lens), max(lens))
    ids = torch.zeros(tokens, dtype=torch.int32, device=device)
    with torch.inference_mode():
        hidden = runner.model(ids, positions, meta, caches)
        rows = opts.max_num_seqs
        logits = runner.model.compute_logits(hidden[:1].expand(rows, -1).contiguous())
        z = lambda dt, v=0: torch.full((rows,), v, dtype=dt, device=device)
        t = SamplingTensors(temperature=z(torch.float32, 1.0), top_k=z(torch.int32, 5), top_p=z(torch.float32, 0.9),
                            min_p=z(torch.float32), seed=z(torch.int64), token_index=z(torch.int32),
                            repetition_penalty=z(torch.float32, 1.1), presence_penalty=z(torch.float32, 0.1),
                            frequency_penalty=z(torch.float32, 0.1), state_row=z(torch.int32))
        sample(logits, t, SamplerFlags(True, True, 20), runner.penalties)
    del caches, hidden, logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    return peak


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"
