"""The benchmark workloads, by name (docs/performance.md, "The workloads").

Each is a model architecture (a config.json shipped with the package, loaded with
dummy weights), a list of prompts as token ids, their sampling parameters, and the
engine options the workload runs under.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field, replace

from slipstream.sampling.params import SamplingParams
from slipstream.sampling.structured import StructuredOutputsParams

CONFIGS = os.path.join(os.path.dirname(__file__), "configs")


@dataclass
class Workload:
    name: str
    model: str  # a folder holding config.json
    prompts: list[list[int]]
    params: list[SamplingParams]
    engine: dict = field(default_factory=dict)
    latency: bool = False  # a latency workload: `slipstream bench` also prints ms per step

    @property
    def num_output_tokens(self) -> int:
        return sum(p.max_tokens for p in self.params)


def seed_8b(new_tokens: int = 8192, name: str = "seed-8b") -> Workload:
    """Llama-3.1-8B shape, 32 requests, 256-token random prompts, greedy, EOS ignored."""
    rng = random.Random(0)
    prompts = [[rng.randrange(128000) for _ in range(256)] for _ in range(32)]
    params = [SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)] * 32
    return Workload(name, os.path.join(CONFIGS, "llama-3.1-8b"), prompts, params,
                    dict(max_num_seqs=32, max_model_len=256 + new_tokens))


def small_256() -> Workload:
    """Qwen3-0.6B shape, 256 requests of random lengths, temperature 0.6, EOS ignored."""
    random.seed(0)
    pairs = [(random.randint(100, 1024), random.randint(100, 1024)) for _ in range(256)]
    prompts = [[random.randint(0, 10000) for _ in range(n)] for n, _ in pairs]
    params = [SamplingParams(max_tokens=m, temperature=0.6, ignore_eos=True, seed=i)
              for i, (_, m) in enumerate(pairs)]
    return Workload("small-256", os.path.join(CONFIGS, "qwen3-0.6b"), prompts, params,
                    dict(max_num_seqs=256, max_model_len=2048))


def tiny(num_requests: int = 8, new_tokens: int = 16) -> Workload:
    """A few requests on the Qwen3-0.6B shape: a smoke test of the benchmark path."""
    rng = random.Random(0)
    prompts = [[rng.randrange(10000) for _ in range(rng.randint(5, 40))] for _ in range(num_requests)]
    params = [SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)] * num_requests
    return Workload("tiny", os.path.join(CONFIGS, "qwen3-0.6b"), prompts, params,
                    dict(max_num_seqs=16, max_model_len=256, max_num_batched_tokens=256))


def seed_8b_short() -> Workload:
    """seed-8b with 1024 new tokens a request."""
    return seed_8b(1024, "seed-8b-short")


def with_fp8_kv_cache(parent: Workload, name: str) -> Workload:
    """`parent` with its KV cache in FP8 (kv_cache_dtype="fp8"; its weights as they are)."""
    return replace(parent, name=name, engine=dict(parent.engine, kv_cache_dtype="fp8"))


def with_fp8_weights(parent: Workload, name: str) -> Workload:
    """`parent` with its decoder's projections quantized to FP8 at load (quantization="fp8",
    one scale an output channel; docs/fp8.md)."""
    return replace(parent, name=name, engine=dict(parent.engine, quantization="fp8"))


def moe_30b_a3b() -> Workload:
    """Qwen3-30B-A3B shape (128 experts, top 8), 256 requests of 256-token random prompts and
    256 new tokens, greedy, EOS ignored: all requests run at once (decode batches of 256)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(150000) for _ in range(256)] for _ in range(256)]
    params = [SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)] * 256
    return Workload("moe-30b-a3b", os.path.join(CONFIGS, "qwen3-30b-a3b"), prompts, params,
                    dict(max_num_seqs=256, max_model_len=512))


def gemma3_8k(window: bool) -> Workload:
    """Gemma 3 1B's shape with a 1024-token window (22 of its 26 layers sliding), 16 requests of
    7936-token random prompts and 512 new tokens (contexts up to 8448), greedy, EOS ignored:
    long-context decode, where the window cuts the sliding layers' KV reads.  Without
    `window` the same model with sliding_window unset: every layer attends to all keys."""
    rng = random.Random(0)
    prompts = [[rng.randrange(262000) for _ in range(7936)] for _ in range(16)]
    params = [SamplingParams(max_tokens=512, temperature=0.0, ignore_eos=True)] * 16
    name, config = ("gemma3-8k-window", "gemma3-1b-window1k") if window else ("gemma3-8k-nowindow",
                                                                               "gemma3-1b-nowindow")
    return Workload(name, os.path.join(CONFIGS, config), prompts, params,
                    dict(max_num_seqs=16, max_model_len=8448))


# The schema of the constrained workloads: a few fields and an array.  With dummy weights the
# model draws among the tokens the mask allows, so its strings seldom close: most requests end
# at max_tokens, some with a complete object ("stop", even under ignore_eos: a terminated
# grammar ends its request).
BENCH_SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string"}, "active": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["id", "name", "active", "tags"]}


def with_json_schema(parent: Workload, name: str, fraction: float) -> Workload:
    """`parent` with `fraction` of its requests (spread evenly) constrained to BENCH_SCHEMA.
    The grammar's vocabulary is SmolLM2's tokenizer padded to the model's vocabulary with
    tokens never allowed (`slipstream bench` builds it: dummy weights bring no tokenizer)."""
    constraint = StructuredOutputsParams(json=BENCH_SCHEMA)
    params = [p.clone(structured_outputs=constraint) if int((i + 1) * fraction) > int(i * fraction) else p
              for i, p in enumerate(parent.params)]
    return replace(parent, name=name, params=params, engine=dict(parent.engine))


def first_requests(parent: Workload, n: int, name: str) -> Workload:
    """A latency workload: the first `n` requests of `parent`, under its engine options."""
    return replace(parent, name=name, prompts=parent.prompts[:n], params=parent.params[:n],
                   engine=dict(parent.engine), latency=True)


WORKLOADS = {
    "seed-8b": seed_8b,
    "seed-8b-short": seed_8b_short,
    "small-256": small_256,
    "tiny": tiny,
    # structured outputs: every request constrained to a JSON schema (BENCH_SCHEMA), or half
    # of them (-half)
    "small-256-json": lambda: with_json_schema(small_256(), "small-256-json", 1.0),
    "small-256-json-half": lambda: with_json_schema(small_256(), "small-256-json-half", 0.5),
    "seed-8b-short-json": lambda: with_json_schema(seed_8b_short(), "seed-8b-short-json", 1.0),
    "seed-8b-short-json-half": lambda: with_json_schema(seed_8b_short(), "seed-8b-short-json-half", 0.5),
    "tiny-json": lambda: with_json_schema(tiny(), "tiny-json", 1.0),
    "tiny-json-half": lambda: with_json_schema(tiny(), "tiny-json-half", 0.5),
    # FP8 weights (docs/fp8.md): half the weight bytes a step reads
    "seed-8b-fp8": lambda: with_fp8_weights(seed_8b(), "seed-8b-fp8"),
    # with the KV cache in FP8 too (kv_cache_dtype="fp8"): half the KV bytes a decode step reads
    "seed-8b-short-fp8": lambda: with_fp8_kv_cache(with_fp8_weights(seed_8b_short(), "seed-8b-short-fp8"),
                                                   "seed-8b-short-fp8"),
    "seed-8b-bs1-fp8": lambda: first_requests(with_fp8_weights(seed_8b_short(), "seed-8b-short-fp8"), 1,
                                              "seed-8b-bs1-fp8"),
    "seed-8b-bs8-fp8": lambda: first_requests(with_fp8_weights(seed_8b_short(), "seed-8b-short-fp8"), 8,
                                              "seed-8b-bs8-fp8"),
    # the 0.6B shape's 256 rows a step with FP8 weights (the mid-row FP8 GEMMs,
    # ops/fp8_dispatch.py) and, as seed-8b-short-fp8, the FP8 KV cache: its decode steps read
    # far more KV than weight bytes
    "small-256-fp8": lambda: with_fp8_kv_cache(with_fp8_weights(small_256(), "small-256-fp8"), "small-256-fp8"),
    # latency: one request (batch size 1) or eight of a throughput workload
    "seed-8b-bs1": lambda: first_requests(seed_8b_short(), 1, "seed-8b-bs1"),
    "seed-8b-bs8": lambda: first_requests(seed_8b_short(), 8, "seed-8b-bs8"),
    "small-bs1": lambda: first_requests(small_256(), 1, "small-bs1"),
    # long-context decode with Gemma 3's sliding window applied, and the same model without it
    "gemma3-8k-window": lambda: gemma3_8k(True),
    "gemma3-8k-nowindow": lambda: gemma3_8k(False),
    # the MoE shape: decode batches of 256 (the whole workload) and the latency variants,
    # whose steps touch 8 experts a layer (bs1), 51.6 (bs8) and 125.9 (bs64) expected
    "moe-30b-a3b": moe_30b_a3b,
    "moe-30b-a3b-bs1": lambda: first_requests(moe_30b_a3b(), 1, "moe-30b-a3b-bs1"),
    "moe-30b-a3b-bs8": lambda: first_requests(moe_30b_a3b(), 8, "moe-30b-a3b-bs8"),
    "moe-30b-a3b-bs64": lambda: first_requests(moe_30b_a3b(), 64, "moe-30b-a3b-bs64"),
}


def get_workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}")
    return WORKLOADS[name]()
