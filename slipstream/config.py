"""Engine configuration: one validated dataclass, clear errors for bad values.

Each field is declared once, with its help text and command-line spelling in the field's
metadata (`option`); `engine_options()` reads them back as the table of engine options that
the CLI flags (slipstream/cli/options.py) and docs/engine-options.md are generated from.
"""
from __future__ import annotations

import typing
from dataclasses import MISSING, dataclass, field, fields

from slipstream.spec.config import SpeculativeConfig

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
# (slipstream/quant's QUANTIZATIONS; tests/test_fp8_weights.py checks both agree)
QUANTIZATIONS = ("none", "fp8")
# (sampling/grammar/backend.py's GRAMMAR_BACKENDS; tests/test_structured_outputs_engine.py checks both agree)
STRUCTURED_OUTPUTS_BACKENDS = ("xgrammar", "llguidance")


def option(default, help: str, *, unset: str | None = None, flag: str | None = None,
           aliases: tuple[str, ...] = (), choices: tuple | None = None, cli_type: type | None = None):
    """A field of EngineConfig with what its CLI flag and doc row need. `unset` says what a
    None default means; `flag` replaces the spelling derived from the name (--max-num-seqs);
    `cli_type` is the flag's value type where the field holds something richer that
    __post_init__ parses from it (a JSON string)."""
    return field(default=default, metadata=dict(help=help, unset=unset, flag=flag,
                                                aliases=aliases, choices=choices, cli_type=cli_type))


@dataclass
class EngineConfig:
    model: str | None = option(
        None, "a Hugging Face folder (config.json + safetensors) or a .gguf file",
        unset="the embedded SmolLM2-135M-Instruct")
    load_format: str = option("auto", "how to read the weights (dummy: random weights from "
                                      "config.json, for benchmarks)", choices=LOAD_FORMATS)
    dtype: str = option("auto", "the model's dtype (auto: float32 on the CPU, the model's "
                                "bf16/fp16 on CUDA)", choices=DTYPES)
    quantization: str = option(
        "none", "fp8: the decoder's linear weights quantized to FP8 e4m3 at load (one scale an output "
                "channel); an FP8 checkpoint (quantization_config: compressed-tensors, fbgemm_fp8, fp8 "
                "with 128x128 blocks) is loaded in FP8 whatever this says (docs/fp8.md)",
        aliases=("-q",), choices=QUANTIZATIONS)
    device: str = option("auto", "where the engine runs (auto: cuda when available)",
                         choices=DEVICES)
    max_model_len: int | None = option(
        None, "longest sequence, prompt and output tokens", unset="the model's max_position_embeddings")
    max_num_seqs: int = option(256, "requests running at once (rows of a step)")
    max_num_batched_tokens: int | None = option(
        None, "tokens per step, the prefill chunk budget",
        unset="16384 on CUDA GPUs of 70 GiB or more (not the A100), else 8192")
    block_size: int = option(16, "tokens per KV cache block (a power of two >= 8)")
    kv_cache_dtype: str = option(
        "auto", "the KV cache's element type: auto (the model's dtype) or fp8 (e4m3 with per-layer "
                "k/v scales from the checkpoint, else 1.0: twice the tokens in the same memory; "
                "fp8_e4m3 is the same; docs/fp8.md)", choices=("auto", "fp8", "fp8_e4m3"))
    num_kv_blocks: int | None = option(None, "a fixed KV cache pool size in blocks",
                                       unset="sized from free memory")
    gpu_memory_utilization: float = option(0.9, "the share of the GPU's memory the engine may use")
    cpu_kv_cache_gib: float = option(1.0, "the KV cache pool's size on the CPU, in GiB")
    enable_prefix_caching: bool = option(
        True, "reuse the KV blocks of prompt prefixes already computed", flag="--prefix-caching")
    async_scheduling: bool | None = option(
        None, "schedule step N+1 on the CPU while step N runs on the GPU",
        unset="on for CUDA, off on the CPU")
    enforce_eager: bool = option(False, "no CUDA graphs: every step runs eagerly")
    cuda_graph_max_batch: int | None = option(
        None, "largest decode batch captured as a CUDA graph", unset="max_num_seqs")
    # prefill/mixed graphs pad rows to max_num_seqs, so they need cuda_graph_max_batch >= max_num_seqs
    cuda_graph_max_tokens: int | None = option(
        None, "largest prefill/mixed step in tokens run as a CUDA graph (0: those steps run eagerly)",
        unset="max_num_batched_tokens")
    # a clone costs 3.5-9 ms against a capture's 10-36 ms, for the same kernels and step times
    # (benchmarks/notes/benchmarks.md, "Engine start"); without a CUDA 12.4+ driver, or under tensor
    # parallelism, the second slot's graphs are captured
    cuda_graph_clone: bool = option(
        True, "the second IO slot's CUDA graphs are copies of the first slot's, re-pointed at its "
              "buffers, instead of captures: half the captures at start")
    seed: int = option(0, "draws the seeds of requests that bring none", flag="--engine-seed")
    trace: bool = option(False, "record a CPU/GPU timeline of every batch")
    debug_kv: bool = option(False, "check that no KV block is freed while an in-flight batch uses it")
    batch_invariant: bool = option(
        False, "a token's result does not depend on its batch, so bf16 sync and async runs agree "
               "token for token (GPU; slower GEMMs and decode attention)")
    tensor_parallel_size: int = option(
        1, "GPUs the model is sharded over, one worker process each (gloo on the CPU)", aliases=("-tp",))
    structured_outputs_backend: str = option(
        "xgrammar", "the grammar library of structured outputs (JSON schema, regex, choice, grammar), "
                    "loaded at the first request that asks for one", choices=STRUCTURED_OUTPUTS_BACKENDS)
    # in-process measured faster than 4 workers on a 16-core GPU host (docs/structured-outputs.md);
    # workers pay where the matchers' CPU time a step nears the GPU's step time
    structured_outputs_workers: int = option(
        0, "processes the constrained requests' grammar matchers are shared out among, started at "
           "the first one: a step's token accepts and bitmask rows run in all of them at once "
           "(0: in the engine core's process; docs/structured-outputs.md)")
    # a dict or a JSON string in, a SpeculativeConfig after __post_init__ (asdict turns it back
    # into a dict, which is how the config reaches the core's process and the workers)
    speculative_config: SpeculativeConfig | None = option(
        None, "speculative decoding, a JSON object: method (ngram, draft_model or eagle3), "
              "num_speculative_tokens, prompt_lookup_min/max (ngram), model (draft_model, eagle3), "
              "disable_by_batch_size (docs/speculative-decoding.md)", unset="off", cli_type=str)

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        for f in fields(self):
            if f.metadata["choices"] is not None:
                _choice(f.name, getattr(self, f.name), f.metadata["choices"])
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        workers = self.structured_outputs_workers
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
            raise ValueError(f"structured_outputs_workers must be a non-negative integer, got {workers!r}")
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


@dataclass(frozen=True)
class EngineOption:
    """One row of the engine options table: an EngineConfig field as an LLM kwarg and a CLI flag."""
    name: str  # the EngineConfig field and LLM keyword
    type: type  # str, int, float or bool
    optional: bool  # None is a value (the default's meaning is `unset`)
    default: object
    help: str
    unset: str | None
    flags: tuple[str, ...]  # the CLI spellings; a bool's negation (--no-X) comes with --X
    choices: tuple | None


def engine_options() -> tuple[EngineOption, ...]:
    """The table of engine options, in EngineConfig's field order."""
    hints = typing.get_type_hints(EngineConfig)
    table = []
    for f in fields(EngineConfig):
        if "help" not in f.metadata or f.default is MISSING:
            raise TypeError(f"EngineConfig.{f.name} must be declared with option(...)")
        base = [t for t in typing.get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
        if f.metadata["cli_type"] is not None:
            base = [f.metadata["cli_type"]]
        flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
        table.append(EngineOption(
            name=f.name, type=base[0], optional=type(None) in typing.get_args(hints[f.name]),
            default=f.default, help=f.metadata["help"], unset=f.metadata["unset"],
            flags=(flag, *f.metadata["aliases"]), choices=f.metadata["choices"]))
    return tuple(table)


def default_max_num_batched_tokens(device_type: str, total_memory: int = 0, name: str = "",
                                   max_num_seqs: int = 1) -> int:
    """Tokens per step when none is given: 16384 on a CUDA GPU of 70 GiB or more (H100 / H200
    class), 8192 elsewhere, and never fewer than max_num_seqs. vLLM's offline engine makes the
    same choice (not on the A100, where it measured a loss). Fewer, larger prefill steps: on
    the H200, small-256's prefill phase took 10 steps and 0.330 s of GPU time against 19 steps
    and 0.362 s (benchmarks/notes/benchmarks.md)."""
    big = device_type == "cuda" and total_memory >= 70 * 2**30 and "a100" not in name.lower()
    return max(16384 if big else 8192, max_num_seqs)


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
