"""Tunables and the split heuristic of the Triton paged-attention kernels
(`slipstream.ops.triton_attention`): tile configs per step kind, how many KV splits a decode
batch takes, and the configs each dtype and head size can actually use."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch
import triton

from slipstream.utils.overrides import config_from_env


# ----------------------------------------------------------------------------- tunables

def _env_rows(name: str, default: int) -> int:
    """A row count from the environment (A/B runs); unset: default."""
    value = os.environ.get(name, str(default))
    if not value.isdigit():
        raise ValueError(f"{name}={value!r}: expected a row count (0 or more)")
    return int(value)


@dataclass(frozen=True)
class DecodeConfig:
    """Tunables of the decode (split-KV) path.  block_n / num_warps apply to batches of up
    to large_batch rows, large_block_n / large_num_warps to larger ones."""
    block_n: int = 64  # KV tokens per tile (any power of two >= 16; may span many blocks)
    num_warps: int = 4
    num_stages: int = 2  # measured best on the H200 (benchmarks/notes/kernel-notes.md)
    min_chunk: int = 256  # fewest KV tokens one split covers (rounded up to block_n)
    # split heuristic: splits = (ctas_per_sm x SMs) // (num_seqs x kv_heads), so all programs
    # are resident at once (4 fit per SM by registers); 2 splits at 32 x 8 heads beat 9 by
    # 4-5 points of copy bandwidth on the H200 (benchmarks/notes/kernel-notes.md, v4)
    ctas_per_sm: int = 4
    max_splits: int = 32
    longest_first: bool = True  # use meta.decode_order when the batch has one
    fused_merge: bool = True  # merge splits in the last program (needs meta.split_counters)
    num_splits: int | None = None  # force a split count (tests, tuning); None: heuristic
    # a batch of more than large_batch rows runs these tiles instead (more programs resident
    # on an SM): on small-256's own batches (0.6B shape, H200) +2-4 points of copy bandwidth
    # at 149-256 rows, -5 at 76-112; one warp rather than two: small-256 0.8% faster
    # (benchmarks/notes/kernel-notes.md, "Tiles by batch size")
    large_batch: int = 128
    large_block_n: int = 32
    large_num_warps: int = 1
    # a batch of at most small_batch rows splits its rows into chunks of (at most)
    # small_min_chunk tokens or more: more programs on a GPU that one row's few splits leave idle.  Batch 1,
    # H200, min_chunk 256 -> 128 (benchmarks/notes/benchmarks.md, "Batch 1"): Qwen3-
    # 0.6B shape 1.31 -> 1.26 ms a step, Llama-3.1-8B shape 4.53 -> 4.45 (64: 1.29, 4.46);
    # 128 for every batch size cost small-256 0.2-0.4%, hence only small batches
    small_batch: int = 8
    small_min_chunk: int = 128
    # a batch of at most prefetch_batch rows (0: none) loads each program's row metadata and
    # first KV tile (all but the row's newest position) before waiting for the previous
    # kernel, so that they stream while the qkv epilogue ends (module doc); the qkv epilogue
    # of a batch of that many tokens or fewer loads its positions, rotary rows and slots
    # early too (ops/fused.py).  Larger batches compile to the same PTX as without it
    # (benchmarks/ptx_diff.py).  On the H200, 0 / 8 alternately, twice
    # (benchmarks/notes/benchmarks.md, "Batch 1"): small-bs1 0.91 -> 0.88 ms a step, seed-8b-bs8
    # 4.87 -> 4.79, seed-8b-bs1, seed-8b-short and small-256 unchanged.
    # `SLIPSTREAM_PREFETCH_BATCH=0` in the environment turns both off (A/B runs)
    prefetch_batch: int = field(default_factory=lambda: _env_rows("SLIPSTREAM_PREFETCH_BATCH", 8))
    # a decode batch of at most epilogue_batch rows (0: none) whose qkv is finished (today: one
    # row on the GEMV, ops/linear.py) runs the qkv epilogue (q/k norm, RoPE, the KV store)
    # inside the decode kernel (`decode_attention(epilogue=)`): one kernel a layer fewer.
    # On the H200, against the code without it in one call: small-bs1 0.88 -> 0.86 ms a step;
    # seed-8b-bs8, seed-8b-short and small-256
    # unchanged (benchmarks/notes/benchmarks.md, "Batch 1").  `SLIPSTREAM_EPILOGUE_BATCH=0` turns
    # it off (A/B runs)
    epilogue_batch: int = field(default_factory=lambda: _env_rows("SLIPSTREAM_EPILOGUE_BATCH", 8))


@dataclass(frozen=True)
class PrefillConfig:
    """Tunables of the prefill / mixed path (None: chosen by the head shape, below)."""
    # q rows per program = query tokens x packed heads (power of two); None: 32 query
    # tokens (64..128 rows), the best on the H200 for 4 heads a KV head (8B, 128 rows) and
    # for 2 (0.6B, 64 rows: 5-13% faster than 128 on small-256's prefill steps)
    block_m: int | None = None
    block_n: int = 32  # KV tokens per tile on the causal diagonal (power of two >= 16)
    num_warps: int | None = None  # None: 8 at 128+ rows a program, else 4
    num_stages: int = 3
    # the KV tiles every row of a program sees in full go wide_n at a time (a multiple of
    # block_n; 0: all block_n). None: 128 at 128+ rows a program, else 64 (the H200's best
    # at 2-16K tokens, benchmarks/notes/benchmarks.md, "Prefill attention")
    wide_n: int | None = None


# the defaults with SLIPSTREAM_DECODE_CONFIG's "field=value,..." changes (A/B runs in the engine)
DEFAULT_DECODE_CONFIG = config_from_env(DecodeConfig, "SLIPSTREAM_DECODE_CONFIG")
DEFAULT_PREFILL_CONFIG = PrefillConfig()


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                      cfg: DecodeConfig, num_sms: int) -> int:
    """Host-side split count: enough programs to fill the GPU, none shorter than
    min_chunk tokens.  Pure function of host ints (CUDA-graph safe)."""
    if cfg.num_splits is not None:
        return max(1, int(cfg.num_splits))
    by_len = _splits_by_length(max_seq_len, cfg)
    by_occupancy = (cfg.ctas_per_sm * num_sms) // max(num_seqs * num_kv_heads, 1)
    return max(1, min(by_len, by_occupancy, cfg.max_splits))


def _splits_by_length(max_seq_len: int, cfg: DecodeConfig) -> int:
    """The most splits a row of max_seq_len tokens can use: one per min_chunk."""
    return triton.cdiv(max(max_seq_len, 1), max(cfg.min_chunk, cfg.block_n))


def decode_split_options(num_seqs: int, num_kv_heads: int, max_seq_len: int, cfg: DecodeConfig,
                         num_sms: int) -> tuple[int, ...]:
    """Split counts worth a CUDA graph at a batch size: the heuristic's (every program
    resident at once: best when rows have similar lengths) and, where it differs, one for
    ragged rows (about two waves of programs, so that the long rows' splits do not run
    alone at the end).  On the H200, 48 rows of 100-2000 tokens ran 11% faster with 3
    splits than with the heuristic's 1, while 32 rows of 4096 lose 3% with 4 instead of 2
    (benchmarks/notes/kernel-notes.md, ragged sweep).  Host ints only."""
    if cfg.num_splits is not None:
        return (max(1, int(cfg.num_splits)),)
    base = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, cfg, num_sms)
    two_waves = triton.cdiv(2 * cfg.ctas_per_sm * num_sms, max(num_seqs * num_kv_heads, 1))
    ragged = max(1, min(two_waves, _splits_by_length(max_seq_len, cfg), cfg.max_splits))
    return (base,) if ragged == base else (base, ragged)


def pick_decode_splits(seq_lens, num_kv_heads: int, options: tuple[int, ...], cfg: DecodeConfig,
                       num_sms: int) -> int:
    """Of `options`, the split count closest to the one that balances this batch: the
    longest row's splits no longer than the mean work per program slot,
    S* = max(len) x slots / (kv_heads x sum(len)); ties go to options[0].  `seq_lens`: the
    real rows' context lengths (host numpy)."""
    total = int(seq_lens.sum()) if len(seq_lens) else 0
    if len(options) == 1 or total == 0:
        return options[0]
    best = int(seq_lens.max()) * cfg.ctas_per_sm * num_sms / (num_kv_heads * total)
    return min(options, key=lambda s: (abs(s - best), s != options[0]))


@dataclass(frozen=True)
class DecodeSplitPolicy:
    """The runner's per-step split choice for one model: `options(size)` are the split counts
    to capture graphs for at a batch size, `pick(seq_lens, size)` the one for a batch."""
    num_kv_heads: int
    max_seq_len: int  # the graphs' bound (max_model_len)
    cfg: DecodeConfig  # effective (see effective_decode_config)
    num_sms: int

    def options(self, num_seqs: int) -> tuple[int, ...]:
        return decode_split_options(num_seqs, self.num_kv_heads, self.max_seq_len, self.cfg, self.num_sms)

    def pick(self, seq_lens, num_seqs: int) -> int:
        return pick_decode_splits(seq_lens, self.num_kv_heads, self.options(num_seqs), self.cfg, self.num_sms)


# ----------------------------------------------------------------------------- host side

def effective_decode_config(cfg: DecodeConfig, dtype: torch.dtype, head_dim: int,
                            num_rows: int = 0) -> DecodeConfig:
    """The config the decode kernel really runs with for `num_rows` rows: the large-batch
    tiles above cfg.large_batch rows, shorter chunks up to cfg.small_batch, legal tile sizes, and smaller tiles / more warps for
    fp32 (its IEEE dot products live in registers)."""
    block_n, num_warps = cfg.block_n, cfg.num_warps
    min_chunk = cfg.min_chunk
    if num_rows > cfg.large_batch:
        block_n, num_warps = cfg.large_block_n, cfg.large_num_warps
    elif 0 < num_rows <= cfg.small_batch:
        min_chunk = min(min_chunk, cfg.small_min_chunk)
    if dtype == torch.float32:
        block_n, num_warps = min(block_n, 32), max(num_warps, 8)
    block_n = max(16, triton.next_power_of_2(block_n))
    min_chunk = triton.cdiv(max(min_chunk, block_n), block_n) * block_n
    return replace(cfg, block_n=block_n, min_chunk=min_chunk, num_warps=num_warps)


def effective_prefill_config(cfg: PrefillConfig, dtype: torch.dtype, head_dim: int,
                             group: int) -> PrefillConfig:
    block_m, block_n, num_warps, wide_n = cfg.block_m, cfg.block_n, cfg.num_warps, cfg.wide_n
    if block_m is None:
        block_m = min(128, max(64, 32 * triton.next_power_of_2(group)))
    if num_warps is None:
        num_warps = 8 if block_m >= 128 else 4
    if wide_n is None:
        wide_n = 128 if block_m >= 128 else 64
    if dtype == torch.float32:
        block_m, block_n, num_warps = min(block_m, 32), min(block_n, 32), max(num_warps, 8)
        wide_n = 0
    elif head_dim > 128:
        block_m, block_n, wide_n = min(block_m, 64), min(block_n, 32), 0
    block_m = max(triton.next_power_of_2(block_m), triton.next_power_of_2(group), 16)
    block_n = max(16, triton.next_power_of_2(block_n))
    wide_n = triton.next_power_of_2(wide_n) if wide_n > block_n else 0
    return replace(cfg, block_m=block_m, block_n=block_n, num_warps=num_warps, wide_n=wide_n)
