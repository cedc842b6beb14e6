"""Engine configuration: one validated dataclass, clear errors for bad values."""
from __future__ import annotations

from dataclasses import dataclass, fields

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class EngineConfig:
    model: str | None = None  # a HF folder, a .gguf file, or None for the embedded SmolLM2
    load_format: str = "auto"
    dtype: str = "auto"  # auto: float32 on CPU, the model's bf16/fp16 on CUDA
    device: str = "auto"  # auto: cuda when available
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 256
    # tokens per step (the prefill chunk budget); default: `default_max_num_batched_tokens`
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None  # fixed KV pool size; default: sized from free memory
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0  # KV pool budget on CPU
    enable_prefix_caching: bool = True
    async_scheduling: bool | None = None  # default: True on CUDA, False on CPU
    enforce_eager: bool = False  # CUDA graphs off
    cuda_graph_max_batch: int | None = None  # largest captured decode batch (default max_num_seqs)
    # largest captured prefill/mixed step in tokens (default max_num_batched_tokens; 0: such
    # steps run eagerly); those graphs pad rows to max_num_seqs, so they need
    # cuda_graph_max_batch >= max_num_seqs
    cuda_graph_max_tokens: int | None = None
    # decode batches padded to at least this many rows, and steps with prompt tokens (padded
    # to max_num_seqs rows), replay one CUDA graph shared by the two IO slots (the step's
    # inputs copied in) instead of one graph per slot: about half the graphs captured at
    # start, for 1-2% of throughput (docs/benchmarks.md, "Engine start").  None: a graph
    # per slot everywhere
    cuda_graph_shared_from: int | None = None
    # the second IO slot's graph of each step is a copy of the first slot's, re-pointed at its
    # buffers (runner/graph_clone.py), not a second capture: half the captures at start, the
    # same kernels and step times (docs/benchmarks.md, "Engine start").  Without a CUDA 12.4+
    # driver, or with tensor parallelism: captured
    cuda_graph_clone: bool = True
    seed: int = 0  # draws the seeds of requests that bring none
    trace: bool = False  # record a CPU/GPU timeline of every batch
    debug_kv: bool = False  # check that no block is freed while an in-flight batch uses it
    # a token's result does not depend on its batch (GPU; slower GEMMs and decode attention):
    # bf16 sync and async runs then agree token for token on any workload
    batch_invariant: bool = False
    # ranks the model is sharded over (Megatron-style), one worker process each (executor/)
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _choice("load_format", self.load_format, LOAD_FORMATS)
        _choice("dtype", self.dtype, DTYPES)
        _choice("device", self.device, DEVICES)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.max_num_batched_tokens is not None:
            _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1) or self.block_size < 8:
            raise ValueError(f"block_size must be a power of two >= 8, got {self.block_size}")
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        if self.cuda_graph_max_batch is not None:
            _positive_int("cuda_graph_max_batch", self.cuda_graph_max_batch)
        if self.cuda_graph_shared_from is not None:
            _positive_int("cuda_graph_shared_from", self.cuda_graph_shared_from)
        if self.cuda_graph_max_tokens is not None and self.cuda_graph_max_tokens != 0:
            _positive_int("cuda_graph_max_tokens", self.cuda_graph_max_tokens)
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not self.cpu_kv_cache_gib > 0:
            raise ValueError(f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running request needs room for one token a step")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)


def default_max_num_batched_tokens(device_type: str, total_memory: int = 0, name: str = "",
                                   max_num_seqs: int = 1) -> int:
    """Tokens per step when none is given: 16384 on a CUDA GPU of 70 GiB or more (H100 / H200
    class), 8192 elsewhere, and never fewer than max_num_seqs. vLLM's offline engine makes the
    same choice (not on the A100, where it measured a loss). Fewer, larger prefill steps: on
    the H200, small-256's prefill phase took 10 steps and 0.330 s of GPU time against 19 steps
    and 0.362 s (docs/benchmarks.md, measured on 1879a42)."""
    big = device_type == "cuda" and total_memory >= 70 * 2**30 and "a100" not in name.lower()
    return max(16384 if big else 8192, max_num_seqs)


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
