"""Triton paged-attention kernels against their pure-torch references.

On CPU the kernels run under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), so sizes are tiny.  Outputs and every cache slot no sequence owns
are poisoned with NaN, so an element left unwritten or read from the wrong place fails.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import replace

import pytest
import torch

from slipstream.ops.attention import paged_attention, paged_attention_ref
from slipstream.ops.metadata import AttentionMetadata, QKVEpilogue
from slipstream.ops.fused import build_cos_sin_cache, qkv_epilogue_ref
from slipstream.ops.triton_attention import decode_attention, epilogue_in_decode_applies, paged_attention_triton, prefill_attention
from slipstream.ops.attention_tuning import DecodeConfig, DecodeSplitPolicy, PrefillConfig, choose_num_splits, decode_split_options, effective_decode_config, effective_prefill_config, pick_decode_splits
from slipstream.ops.triton_qkv_epilogue import qkv_epilogue_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Tiny tiles for the interpreter: many KV tiles, many splits, many query tiles.
SMALL_DECODE = DecodeConfig(block_n=16, min_chunk=16, num_warps=1, num_stages=1, prefetch_batch=0)
SMALL_PREFILL = PrefillConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)


def make_batch(seqs, num_kv_heads, group, head_dim, block_size, dtype, *, seed, max_seq_len=None,
               extra_tokens=0, device=DEVICE, order=True, counters=True):
    """seqs: list of (seq_len, query_len).  Returns q, k_cache, v_cache, meta.

    Blocks are assigned in a random order; slots no sequence owns hold NaN, and every
    unused block-table entry points at a NaN block.  `order` / `counters` fill the
    metadata's decode_order (longest row first) and split_counters (the runner's way);
    without them the decode kernel takes rows in order and merges splits in a reduce pass.
    """
    g = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    blocks_per_seq = [(s + block_size - 1) // block_size for s, _ in seqs]
    num_used = sum(blocks_per_seq)
    num_blocks = num_used + 3  # spare blocks stay NaN
    perm = torch.randperm(num_blocks, generator=g)
    nan_block = int(perm[-1])
    width = max(max(blocks_per_seq, default=0), 1) + 1
    block_table = torch.full((len(seqs), width), nan_block, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    i = 0
    for r, ((seq_len, _), nb) in enumerate(zip(seqs, blocks_per_seq)):
        ids = perm[i:i + nb]
        i += nb
        block_table[r, :nb] = ids.to(torch.int32)
        for j, b in enumerate(ids.tolist()):
            n = min(block_size, seq_len - j * block_size)
            k_cache[b, :n] = torch.randn((n, num_kv_heads, head_dim), generator=g).to(dtype)
            v_cache[b, :n] = torch.randn((n, num_kv_heads, head_dim), generator=g).to(dtype)
    q_lens = [ql for _, ql in seqs]
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    num_tokens = int(qsl[-1]) + extra_tokens
    q = torch.randn((num_tokens, num_heads, head_dim), generator=g).to(dtype)
    seq_lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=qsl.to(device), seq_lens=seq_lens.to(device), block_table=block_table.to(device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int32, device=device),
        max_query_len=max(q_lens + [1]),
        max_seq_len=max_seq_len if max_seq_len is not None else max(s for s, _ in seqs),
        decode_order=torch.argsort(-seq_lens, stable=True).to(torch.int32).to(device) if order else None,
        split_counters=torch.zeros(len(seqs) * num_kv_heads, dtype=torch.int32, device=device)
        if counters else None)
    return q.to(device), k_cache.to(device), v_cache.to(device), meta


def tolerances(dtype):
    return {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3),
            torch.bfloat16: (2e-2, 2e-2)}[dtype]


def check_attention(seqs, num_kv_heads, group, head_dim, block_size, dtype, *, seed,
                    max_seq_len=None, extra_tokens=0, order=True, counters=True, **kwargs):
    q, k_cache, v_cache, meta = make_batch(seqs, num_kv_heads, group, head_dim, block_size, dtype,
                                           seed=seed, max_seq_len=max_seq_len,
                                           extra_tokens=extra_tokens, order=order, counters=counters)
    scale = head_dim ** -0.5
    expected = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    out = torch.full_like(q, float("nan"))
    got = paged_attention_triton(q, k_cache, v_cache, meta, scale, out=out, **kwargs)
    assert got is out
    assert not torch.isnan(out).any(), "unwritten or NaN-contaminated output"
    atol, rtol = tolerances(dtype)
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    # Padding rows and tokens past the last sequence are exactly zero.
    starts = meta.query_start_loc.tolist()
    for r, (seq_len, _) in enumerate(seqs):
        if seq_len == 0:
            assert (out[starts[r]:starts[r + 1]] == 0).all()
    assert (out[starts[-1]:] == 0).all()
    if counters:  # the split merge leaves its counters zero for the next call
        assert (meta.split_counters == 0).all()
    return out, expected


# ----------------------------------------------------------------------------- decode

DECODE_SEQS = [(1, 1), (7, 1), (8, 1), (9, 1), (0, 1), (16, 1), (17, 1), (50, 1)]


@pytest.mark.quick_sample(2)
@pytest.mark.parametrize("num_kv_heads,group,block_size,splits", [
    (2, 1, 8, 1),
    (1, 3, 16, 3),
    (2, 4, 8, 4),
    (1, 8, 16, None),
])
def test_decode_fp32(num_kv_heads, group, block_size, splits):
    check_attention(DECODE_SEQS, num_kv_heads, group, 32, block_size, torch.float32,
                    seed=10 + group, decode_config=SMALL_DECODE, num_splits=splits)


@pytest.mark.slow
def test_decode_bf16_many_splits():
    # 7 splits over 50 tokens: chunk 16 -> splits 4..6 of the longest row exit early.
    check_attention(DECODE_SEQS, 2, 4, 64, 16, torch.bfloat16, seed=3,
                    decode_config=SMALL_DECODE, num_splits=7)


@pytest.mark.slow
@pytest.mark.quick_sample(1)
@pytest.mark.parametrize("order,counters", [(False, False), (True, False), (False, True)])
def test_decode_without_row_order_or_merge_counters(order, counters):
    # Rows in batch order and/or splits merged by the separate reduce pass (metadata
    # without decode_order / split_counters, e.g. from a caller other than the runner;
    # counters without an order also take the reduce pass).
    check_attention(DECODE_SEQS, 2, 4, 32, 8, torch.float32, seed=12, decode_config=SMALL_DECODE,
                    num_splits=3, order=order, counters=counters)


@pytest.mark.slow
def test_decode_merge_counters_reused():
    # The same counters serve call after call (as the layers of a step do).
    q, kc, vc, meta = make_batch(DECODE_SEQS, 2, 2, 32, 8, torch.float32, seed=13)
    expected = paged_attention_ref(q, kc, vc, meta, 0.3)
    for splits in (2, 5, 3):
        out = paged_attention_triton(q, kc, vc, meta, 0.3, decode_config=SMALL_DECODE, num_splits=splits)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
        assert (meta.split_counters == 0).all()


@pytest.mark.slow
def test_decode_graph_bound_and_padding():
    # A graph-style batch: max_seq_len far above the real lengths (heuristic picks many
    # splits, most exit), an empty row, and trailing padding tokens in q.
    seqs = [(33, 1), (0, 1), (5, 1), (12, 0), (24, 1)]
    cfg = DecodeConfig(block_n=16, min_chunk=16, num_warps=1, num_stages=1, max_splits=8)
    assert choose_num_splits(len(seqs), 2, 4096, cfg, 132) == 8
    check_attention(seqs, 2, 3, 32, 8, torch.float32, seed=5, max_seq_len=4096, extra_tokens=2,
                    decode_config=cfg)


def test_split_heuristic():
    cfg = DecodeConfig(block_n=64, min_chunk=256, ctas_per_sm=4, max_splits=32)
    # Llama-8B decode, batch 32 x 8K: 256 (seq, kv head) pairs, 2 splits fit 4 x 132 programs.
    assert choose_num_splits(32, 8, 8192, cfg, 132) == 2
    assert choose_num_splits(16, 8, 8192, cfg, 132) == 4
    assert choose_num_splits(256, 8, 1024, cfg, 132) == 1  # enough programs already
    assert choose_num_splits(1, 8, 200, cfg, 132) == 1  # too short to split
    assert choose_num_splits(1, 8, 600, cfg, 132) == 3  # at most one split per min_chunk
    assert choose_num_splits(1, 1, 1 << 20, cfg, 132) == 32  # capped
    assert choose_num_splits(1, 1, 1 << 20, replace(cfg, num_splits=5), 132) == 5
    # The decode path's effective config: fp32 shrinks tiles; min_chunk is a tile multiple.
    eff = effective_decode_config(DecodeConfig(block_n=64, min_chunk=100), torch.float32, 128)
    assert eff.block_n == 32 and eff.min_chunk == 128 and eff.num_warps >= 8
    # more than large_batch rows: the large-batch tiles
    for rows, tiles in ((128, (64, 4)), (129, (32, 1)), (256, (32, 1))):
        eff = effective_decode_config(DecodeConfig(), torch.bfloat16, 128, num_rows=rows)
        assert (eff.block_n, eff.num_warps) == tiles and eff.min_chunk == 256
    # at most small_batch rows: shorter chunks (more programs for few rows)
    for rows, chunk in ((1, 128), (8, 128), (9, 256)):
        assert effective_decode_config(DecodeConfig(), torch.bfloat16, 128, num_rows=rows).min_chunk == chunk


def test_prefill_rows_per_program():
    # 32 query tokens a program by default (64..128 q rows), unless block_m is given
    rows = {g: effective_prefill_config(PrefillConfig(), torch.bfloat16, 128, g).block_m for g in (1, 2, 3, 4, 8)}
    assert rows == {1: 64, 2: 64, 3: 128, 4: 128, 8: 128}
    assert effective_prefill_config(PrefillConfig(block_m=32), torch.bfloat16, 128, 2).block_m == 32
    assert effective_prefill_config(PrefillConfig(), torch.float32, 128, 4).block_m == 32


def test_decode_large_batch_tiles():
    # the large-batch tiles (here from 3 rows on) give the same results
    cfg = replace(SMALL_DECODE, large_batch=2, large_block_n=32, large_num_warps=2)
    check_attention(DECODE_SEQS, 2, 4, 32, 8, torch.float32, seed=15, decode_config=cfg)


def prefetch_decode() -> DecodeConfig:
    # (made in the tests, not at import: benchmarks/ptx_diff.py runs this file's compile
    # check in older trees, whose DecodeConfig has no prefetch_batch; SMALL_DECODE, the
    # plain path, names it since this tree's default is 8)
    return replace(SMALL_DECODE, prefetch_batch=8)


def _decode_launches(monkeypatch):
    """The constexprs of each decode-kernel launch (the launch itself still runs)."""
    import slipstream.ops.triton_attention as ta
    launches, kernel = [], ta._decode_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append(kw)
                return kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(ta, "_decode_kernel", Recorder())
    return launches


def test_prefetch_batch_from_the_environment(monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_PREFETCH_BATCH", raising=False)
    assert DecodeConfig().prefetch_batch == 8  # on by default (timed: module doc)
    monkeypatch.setenv("SLIPSTREAM_PREFETCH_BATCH", "0")
    assert DecodeConfig().prefetch_batch == 0
    monkeypatch.setenv("SLIPSTREAM_PREFETCH_BATCH", "16")
    assert DecodeConfig().prefetch_batch == 16
    monkeypatch.setenv("SLIPSTREAM_PREFETCH_BATCH", "eight")
    with pytest.raises(ValueError, match="SLIPSTREAM_PREFETCH_BATCH='eight'"):
        DecodeConfig()


@pytest.mark.quick_sample(1)
@pytest.mark.parametrize("dtype,num_kv_heads,group,splits", [
    (torch.float32, 2, 1, 1), (torch.float32, 1, 3, 3), (torch.bfloat16, 2, 4, 7), (torch.float32, 2, 2, None)])
def test_decode_prefetch_matches_the_reference(dtype, num_kv_heads, group, splits, monkeypatch):
    # DECODE_SEQS (8 rows: lengths 0, 1, at and around the 16-token tile and chunk) with the
    # row metadata and first KV tile loaded before the PDL wait, the newest position after it
    launches = _decode_launches(monkeypatch)
    check_attention(DECODE_SEQS, num_kv_heads, group, 32, 8, dtype, seed=40 + group,
                    decode_config=prefetch_decode(), num_splits=splits)
    assert [kw["PREFETCH"] for kw in launches] == [True]


@pytest.mark.slow
def test_decode_prefetch_only_up_to_prefetch_batch(monkeypatch):
    launches = _decode_launches(monkeypatch)
    check_attention(DECODE_SEQS + [(3, 1)], 2, 2, 32, 8, torch.float32, seed=44,
                    decode_config=prefetch_decode())
    check_attention(DECODE_SEQS[:1], 2, 2, 32, 8, torch.float32, seed=45, decode_config=SMALL_DECODE)
    assert [kw["PREFETCH"] for kw in launches] == [False, False]


@pytest.mark.slow
@pytest.mark.parametrize("graph_layout", [False, True])
def test_mixed_decode_rows_with_prefetch(graph_layout, monkeypatch):
    # a mixed batch's single-token rows through the prefetching decode kernel; its prefill
    # rows (skipped there) load no K/V before the wait, and padding rows none at all
    seqs = MIXED_WITH_DECODES[:6] + ([(0, 0), (0, 0)] if graph_layout else [])
    q, k_cache, v_cache, meta = make_batch(seqs, 2, 2, 32, 8, torch.float32, seed=46, extra_tokens=2)
    meta = _split_decode_rows(meta, graph_layout)
    scale = 32 ** -0.5
    expected = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    launches = _decode_launches(monkeypatch)
    out = torch.full_like(q, float("nan"))
    paged_attention_triton(q, k_cache, v_cache, meta, scale, out=out, decode_config=prefetch_decode(),
                           prefill_config=SMALL_PREFILL, num_splits=3)
    assert [kw["PREFETCH"] for kw in launches] == [True]
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert (meta.split_counters == 0).all()


def test_split_options_and_the_pick_from_row_lengths():
    import numpy as np
    cfg = DecodeConfig(block_n=64, min_chunk=256, ctas_per_sm=4, max_splits=32)
    # 32 rows x 8 KV heads: the resident heuristic (2) and two waves (5); rows of one
    # length keep 2 (seed-8b), ragged rows take 5
    assert decode_split_options(32, 8, 8448, cfg, 132) == (2, 5)
    assert pick_decode_splits(np.full(32, 4096), 8, (2, 5), cfg, 132) == 2
    ragged = np.random.default_rng(0).integers(100, 2000, 32)
    ragged[0] = 2000
    assert pick_decode_splits(ragged, 8, (2, 5), cfg, 132) == 5
    # 48 rows (small-256-like): 1 or 3
    assert decode_split_options(48, 8, 2048, cfg, 132) == (1, 3)
    assert pick_decode_splits(np.full(48, 1000), 8, (1, 3), cfg, 132) == 1
    assert pick_decode_splits(np.r_[np.full(47, 700), 2000], 8, (1, 3), cfg, 132) == 3
    # enough rows for two waves already, or a forced count: one graph
    assert decode_split_options(256, 8, 2048, cfg, 132) == (1,)
    assert decode_split_options(32, 8, 8448, replace(cfg, num_splits=3), 132) == (3,)
    assert pick_decode_splits(np.zeros(4, np.int64), 8, (2, 5), cfg, 132) == 2  # all padding
    # the runner's policy object: the same two functions with the model's numbers bound
    policy = DecodeSplitPolicy(8, 8448, cfg, 132)
    assert policy.options(32) == (2, 5) and policy.pick(ragged, 32) == 5
    assert policy.pick(np.full(20, 4096), 24) == decode_split_options(24, 8, 8448, cfg, 132)[0]


@pytest.mark.slow
def test_metadata_split_count_is_used():
    seqs = [(70, 1), (9, 1), (0, 1), (64, 1), (33, 1)]
    q, k_cache, v_cache, meta = make_batch(seqs, 2, 2, 32, 8, torch.float32, seed=41)
    outs = []
    for m, forced in ((replace(meta, num_splits=3), None), (meta, 3), (meta, 1)):
        out = torch.full_like(q, float("nan"))
        paged_attention_triton(q, k_cache, v_cache, m, 32 ** -0.5, out=out, decode_config=SMALL_DECODE,
                               num_splits=forced)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])  # meta.num_splits = 3 is a forced 3
    assert not torch.equal(outs[0], outs[2])  # (another split count sums in another order)
    expected = paged_attention_ref(q, k_cache, v_cache, meta, 32 ** -0.5)
    torch.testing.assert_close(outs[0], expected, atol=2e-5, rtol=2e-5)


def _rows_of(seqs_subset, all_seqs, dtype, **kw):
    """Outputs of the rows `seqs_subset` (indices into all_seqs) computed in a batch of
    just those rows, with batch_invariant=True; caches and q are shared via the seed."""
    q, kc, vc, meta = make_batch(all_seqs, 2, 4, 32, 8, dtype, seed=21)
    starts = meta.query_start_loc.tolist()
    sub_q = torch.cat([q[starts[i]:starts[i + 1]] for i in seqs_subset])
    lens = [all_seqs[i][1] for i in seqs_subset]
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    idx = torch.tensor(seqs_subset)
    sub = AttentionMetadata(qsl.to(q.device), meta.seq_lens[idx.to(q.device)], meta.block_table[idx.to(q.device)],
                            meta.slot_mapping[:sub_q.shape[0]], max(lens), meta.max_seq_len)
    out = paged_attention_triton(sub_q, kc, vc, sub, 0.25, batch_invariant=True, **kw)
    ref = paged_attention_ref(sub_q, kc, vc, sub, 0.25)
    return out, ref


@pytest.mark.slow
@pytest.mark.quick_sample(1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_rows_match_in_any_batch(dtype):
    # A decode row alone, among other decodes, and inside a mixed batch with prefill chunks:
    # with batch_invariant=True the same kernel computes it, to the same bits.
    seqs = [(50, 1), (33, 33), (17, 1), (40, 9), (9, 1)]
    kw = dict(prefill_config=SMALL_PREFILL)
    mixed, ref = _rows_of([0, 1, 2, 3, 4], seqs, dtype, **kw)
    atol, rtol = tolerances(dtype)
    torch.testing.assert_close(mixed.float(), ref.float(), atol=atol, rtol=rtol)
    decodes, _ = _rows_of([0, 2, 4], seqs, dtype, **kw)
    alone, _ = _rows_of([2], seqs, dtype, **kw)
    assert torch.equal(decodes[1], mixed[34]) and torch.equal(alone[0], mixed[34])
    assert torch.equal(decodes[0], mixed[0]) and torch.equal(decodes[2], mixed[-1])
    chunk, _ = _rows_of([3], seqs, dtype, **kw)  # a prefill chunk alone
    assert torch.equal(chunk, mixed[35:44])


@pytest.mark.slow
def test_batch_invariant_prompt_chunking():
    # The last 9 tokens of a 40-token prompt, as a chunk over the cached prefix or inside
    # the whole prompt (and as single decode steps): the same bits (batch_invariant=True).
    q, kc, vc, meta = make_batch([(40, 40)], 2, 4, 32, 8, torch.bfloat16, seed=22)
    whole = paged_attention_triton(q, kc, vc, meta, 0.25, batch_invariant=True, prefill_config=SMALL_PREFILL)
    for start in (31, 39):
        n = 40 - start
        part = AttentionMetadata(torch.tensor([0, n], dtype=torch.int32, device=q.device), meta.seq_lens,
                                 meta.block_table, meta.slot_mapping[:n], n, 40)
        got = paged_attention_triton(q[start:].contiguous(), kc, vc, part, 0.25, batch_invariant=True,
                                     prefill_config=SMALL_PREFILL)
        assert torch.equal(got, whole[start:])


def test_paged_attention_dispatch_out():
    # CPU dispatch honours out= (the GPU dispatch passes it to the kernel).
    q, k_cache, v_cache, meta = make_batch([(5, 2), (3, 1)], 1, 2, 32, 8, torch.float32, seed=9,
                                           device="cpu")
    out = torch.full_like(q, float("nan"))
    got = paged_attention(q, k_cache, v_cache, meta, 0.2, out=out)
    assert got is out
    torch.testing.assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, 0.2))


# ----------------------------------------------------------------------------- the qkv epilogue inside

def epilogue_case(lens, num_kv_heads, group, head_dim, block_size, dtype, *, seed, norms=False,
                  device=DEVICE, max_seq_len=None):
    """A decode batch as the layer hands it over at one row: the qkv GEMV's finished output
    [rows, (Hq + 2 Hk) D], the epilogue's inputs (rotary rows at each row's newest position;
    Qwen3's q/k norm weights with `norms`), and caches whose newest slots hold NaN until
    something stores them.  Returns (qkv, epi, k_cache, v_cache, meta)."""
    _, kc, vc, meta = make_batch([(n, 1) for n in lens], num_kv_heads, group, head_dim, block_size, dtype,
                                 seed=seed, device=device, max_seq_len=max_seq_len)
    g = torch.Generator().manual_seed(seed + 1)
    bt = meta.block_table.cpu()
    newest = torch.tensor([int(bt[r, (n - 1) // block_size]) * block_size + (n - 1) % block_size if n else -1
                           for r, n in enumerate(lens)], dtype=torch.int32)
    meta = replace(meta, slot_mapping=newest.to(device))
    for slot in newest[newest >= 0].tolist():
        kc[slot // block_size, slot % block_size] = float("nan")
        vc[slot // block_size, slot % block_size] = float("nan")
    width = (num_kv_heads * group + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(len(lens), width, generator=g).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2) / head_dim))

    def weight():
        return (1 + 0.2 * torch.randn(head_dim, generator=g)).to(dtype).to(device) if norms else None

    epi = QKVEpilogue(torch.tensor([max(n - 1, 0) for n in lens], dtype=torch.int32, device=device),
                      build_cos_sin_cache(inv_freq, max(lens) + 8).to(device), weight(), weight(), 1e-6)
    return qkv.to(device), epi, kc, vc, meta


def epilogue_then_attention(qkv, epi, kc, vc, meta, num_heads, **kwargs):
    """The two-kernel path: the qkv epilogue kernel, then the decode kernel."""
    num_kv_heads, head_dim = kc.shape[2], kc.shape[3]
    q = qkv_epilogue_triton(qkv.clone(), epi.positions, epi.cos_sin_cache, kc, vc, meta.slot_mapping,
                            num_heads, num_kv_heads, head_dim, epi.q_norm_weight, epi.k_norm_weight, epi.eps)
    return paged_attention_triton(q, kc, vc, meta, head_dim ** -0.5, **kwargs)


def attention_with_epilogue_inside(qkv, epi, kc, vc, meta, num_heads, **kwargs):
    head_dim = kc.shape[3]
    raw_q = qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
    return paged_attention_triton(raw_q, kc, vc, meta, head_dim ** -0.5, epilogue=epi, **kwargs)


def check_epilogue_inside(lens, num_kv_heads, group, head_dim, block_size, dtype, *, seed, norms,
                          equal=True, **kwargs):
    """The epilogue inside the decode kernel against the two-kernel path (bit for bit when
    `equal`; else within one bf16 step: two compiled kernels may reduce in another order) and
    the torch references; every newest slot starts as NaN, so a read before the store, or a
    missing store, fails."""
    qkv, epi, kc, vc, meta = epilogue_case(lens, num_kv_heads, group, head_dim, block_size, dtype,
                                           seed=seed, norms=norms, max_seq_len=kwargs.pop("max_seq_len", None))
    num_heads = num_kv_heads * group
    kc2, vc2 = kc.clone(), vc.clone()
    two = epilogue_then_attention(qkv, epi, kc2, vc2, meta, num_heads, **kwargs)
    one = attention_with_epilogue_inside(qkv, epi, kc, vc, meta, num_heads, **kwargs)
    assert not torch.isnan(one).any()
    for got, want in [(one, two), (kc.nan_to_num(7.0), kc2.nan_to_num(7.0)), (vc.nan_to_num(7.0), vc2.nan_to_num(7.0))]:
        if equal:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1.6e-2)
    kr, vr = kc.clone(), vc.clone()
    q_ref = qkv_epilogue_ref(qkv, epi.positions, epi.cos_sin_cache, kr, vr, meta.slot_mapping, num_heads,
                             num_kv_heads, head_dim, epi.q_norm_weight, epi.k_norm_weight, epi.eps)
    # bf16: q and K are each within one bf16 step of the reference's (the epilogue kernel's
    # tolerance, tests/test_fused_kernels.py), and attention carries that over
    atol, rtol = tolerances(dtype) if dtype == torch.float32 else (8e-2, 5e-2)
    torch.testing.assert_close(one.float(), paged_attention_ref(q_ref, kr, vr, meta, head_dim ** -0.5).float(),
                               atol=atol, rtol=rtol)
    assert (meta.split_counters == 0).all()


@pytest.mark.quick_sample(1)
@pytest.mark.parametrize("dtype,num_kv_heads,group,norms,splits,prefetch", [
    (torch.float32, 2, 2, True, None, 0),   # Qwen3: q/k norms
    (torch.float32, 1, 3, False, 3, 8),     # Llama / Qwen2 shapes
    (torch.bfloat16, 2, 4, True, 1, 8),     # one split: the output written directly
    (torch.bfloat16, 2, 1, False, 7, 0),
])
@pytest.mark.slow
def test_decode_with_the_epilogue_inside_equals_the_two_kernels(dtype, num_kv_heads, group, norms,
                                                                 splits, prefetch, monkeypatch):
    """Rows: empty (padding), 1 token (the newest is position 0), at / across the 8-token tile
    and chunk edges."""
    launches = _decode_launches(monkeypatch)
    # bit for bit under the interpreter; compiled (on a GPU), within a rounding step
    check_epilogue_inside([0, 1, 7, 8, 9, 16, 17, 50], num_kv_heads, group, 16, 8, dtype, seed=70 + group,
                          norms=norms, decode_config=replace(SMALL_DECODE, prefetch_batch=prefetch),
                          num_splits=splits, equal=DEVICE == "cpu")
    assert [kw.get("EPILOGUE", False) for kw in launches] == [False, True]


def test_epilogue_inside_applies_to_small_decode_batches_only(monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_EPILOGUE_BATCH", raising=False)
    assert DecodeConfig().epilogue_batch == 8
    qkv, epi, kc, vc, meta = epilogue_case([5] * 8, 2, 2, 16, 8, torch.bfloat16, seed=80, norms=True)
    assert epilogue_in_decode_applies(qkv, epi, kc, meta, 4)
    nine = epilogue_case([5] * 9, 2, 2, 16, 8, torch.bfloat16, seed=81)
    assert not epilogue_in_decode_applies(nine[0], nine[1], nine[2], nine[4], 4)  # > epilogue_batch rows
    assert not epilogue_in_decode_applies(qkv, epi, kc, meta, 4, replace(SMALL_DECODE, epilogue_batch=0))
    assert not epilogue_in_decode_applies(qkv, epi, kc, replace(meta, max_query_len=2), 4)  # a prefill row
    assert not epilogue_in_decode_applies(torch.cat([qkv, qkv[:1]]), epi, kc, meta, 4)  # a token in no row
    fp32_norm = replace(epi, q_norm_weight=epi.q_norm_weight.float())  # a float32 intermediate
    assert not epilogue_in_decode_applies(qkv, fp32_norm, kc, meta, 4)
    assert not epilogue_in_decode_applies(qkv, epi, kc.half(), meta, 4)
    unfinished = [replace(epi, hidden=torch.ones(8, 48, dtype=torch.bfloat16)),  # the folded norm's row scale
                  replace(epi, bias=torch.ones(qkv.shape[1], dtype=torch.bfloat16))]
    for e in unfinished:
        assert not epilogue_in_decode_applies(qkv, e, kc, meta, 4)
        with pytest.raises(ValueError, match="finished qkv"):
            attention_with_epilogue_inside(qkv, e, kc, vc, meta, 4)
    monkeypatch.setenv("SLIPSTREAM_EPILOGUE_BATCH", "0")
    assert not epilogue_in_decode_applies(qkv, epi, kc, meta, 4, DecodeConfig())
    with pytest.raises(ValueError, match="decode batch"):
        attention_with_epilogue_inside(qkv, epi, kc, vc, replace(meta, max_query_len=2), 4)


# ----------------------------------------------------------------------------- prefill / mixed

MIXED_SEQS = [(20, 20), (37, 5), (9, 1), (0, 3), (33, 33), (16, 16), (48, 17)]


@pytest.mark.quick_sample(1)
@pytest.mark.parametrize("num_kv_heads,group,block_size,dtype", [
    (1, 3, 16, torch.float32),
    (2, 1, 8, torch.float32),
    (2, 4, 8, torch.bfloat16),
    (1, 8, 16, torch.float32),
])
@pytest.mark.slow
def test_mixed(num_kv_heads, group, block_size, dtype):
    check_attention(MIXED_SEQS, num_kv_heads, group, 32, block_size, dtype, seed=20 + group,
                    extra_tokens=1, prefill_config=SMALL_PREFILL)


MIXED_WITH_DECODES = [(20, 20), (70, 1), (9, 1), (0, 1), (33, 33), (1, 1), (48, 17), (64, 1)]


def _split_decode_rows(meta, graph_layout=False):
    # the runner's way (runner/inputs._single_token_rows): single-token rows, longest first,
    # then the others; a mixed CUDA graph's decode kernel covers every row (num_decode = all)
    qsl, lens = meta.query_start_loc.cpu(), meta.seq_lens.cpu()
    is_single = (qsl[1:] - qsl[:-1]) == 1
    single = torch.nonzero(is_single).flatten()
    single = single[torch.argsort(-lens[single], stable=True)]
    order = torch.cat([single, torch.nonzero(~is_single).flatten()]).to(torch.int32)
    num_decode = meta.num_seqs if graph_layout else len(single)
    return replace(meta, decode_order=order.to(meta.seq_lens.device), num_decode=num_decode)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,splits,graph_layout", [(torch.float32, 1, False), (torch.float32, 3, False),
                                                       (torch.bfloat16, 2, False), (torch.float32, 3, True)])
def test_mixed_decode_rows_take_the_decode_kernel(dtype, splits, graph_layout, monkeypatch):
    seqs = MIXED_WITH_DECODES + ([(0, 0), (0, 0)] if graph_layout else [])  # graph padding rows
    q, k_cache, v_cache, meta = make_batch(seqs, 2, 2, 32, 8, dtype, seed=31, extra_tokens=2)
    meta = _split_decode_rows(meta, graph_layout)
    num_rows = len(seqs) if graph_layout else 5
    assert meta.num_decode == num_rows
    scale = 32 ** -0.5
    expected = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    launched = []
    import slipstream.ops.triton_attention as ta
    for name in ("decode_attention", "prefill_attention"):
        fn = getattr(ta, name)
        monkeypatch.setattr(ta, name, lambda *a, _fn=fn, _n=name, **kw: (launched.append((_n, kw)), _fn(*a, **kw)))
    out = torch.full_like(q, float("nan"))
    ta.paged_attention_triton(q, k_cache, v_cache, meta, scale, out=out, decode_config=SMALL_DECODE,
                              prefill_config=SMALL_PREFILL, num_splits=splits)
    assert [n for n, _ in launched] == ["prefill_attention", "decode_attention"]
    assert launched[0][1] == {"skip_single": True} and launched[1][1] == {"num_rows": num_rows}
    atol, rtol = tolerances(dtype)
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    assert (out[int(meta.query_start_loc[-1]):] == 0).all()
    assert (meta.split_counters == 0).all()


@pytest.mark.slow
def test_prefill_and_decode_kernels_called_alone():
    # the public entry points one at a time, as a benchmark times them: the prefill kernel
    # skipping single-token rows, then the decode kernel over those rows, fill every row
    q, k_cache, v_cache, meta = make_batch(MIXED_WITH_DECODES, 2, 2, 32, 8, torch.float32, seed=33)
    meta = _split_decode_rows(meta)
    scale = 32 ** -0.5
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, k_cache, v_cache, meta, scale, out, SMALL_PREFILL, skip_single=True)
    is_single = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]) == 1
    single_tokens = meta.query_start_loc[:-1][is_single].long()
    assert out[single_tokens].isnan().all()  # left to the decode kernel
    decode_attention(q, k_cache, v_cache, meta, scale, out, replace(SMALL_DECODE, num_splits=3),
                     num_rows=meta.num_decode)
    expected = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert (meta.split_counters == 0).all()


@pytest.mark.slow
def test_mixed_many_seqs():
    # More sequences than one search chunk (128) of the prefill kernel's sequence lookup.
    g = torch.Generator().manual_seed(11)
    seqs = []
    for _ in range(140):
        seq_len = int(torch.randint(0, 12, (), generator=g))
        q_len = int(torch.randint(1, seq_len + 1, (), generator=g)) if seq_len else 0
        seqs.append((seq_len, q_len))
    seqs[-1] = (10, 10)
    check_attention(seqs, 1, 2, 32, 8, torch.float32, seed=12, prefill_config=SMALL_PREFILL)


def test_prefill_larger_tiles_fp16():
    # Query tiles larger than the sequences, KV tiles spanning 4 blocks, head_dim 64.
    seqs = [(70, 70), (40, 9), (1, 1), (19, 2)]
    check_attention(seqs, 2, 2, 64, 8, torch.float16, seed=7,
                    prefill_config=PrefillConfig(block_m=64, block_n=32, num_warps=2, num_stages=1))


WIDE_PREFILL = PrefillConfig(block_m=32, block_n=16, num_warps=2, num_stages=1, wide_n=64)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_wide_kv_tiles(dtype):
    # Fresh prompts, a prefix-cache hit, a chunk of a long prompt, a decode row: the tiles
    # every row sees in full go 64 positions (8 blocks) at a time, the diagonal 16 at a time.
    seqs = [(300, 300), (260, 37), (200, 5), (129, 1), (64, 64), (63, 63), (0, 0)]
    check_attention(seqs, 2, 2, 32, 8, dtype, seed=21, prefill_config=WIDE_PREFILL)


def test_wide_tiles_config_rules():
    eff = effective_prefill_config
    assert eff(PrefillConfig(block_n=32, wide_n=100), torch.bfloat16, 128, 4).wide_n == 128
    assert eff(PrefillConfig(block_n=32, wide_n=32), torch.bfloat16, 128, 4).wide_n == 0  # not wider
    assert eff(PrefillConfig(wide_n=128), torch.float32, 128, 4).wide_n == 0
    assert eff(PrefillConfig(wide_n=128), torch.bfloat16, 256, 4).wide_n == 0


@pytest.mark.slow
def test_batch_invariant_ignores_wide_tiles():
    # batch-invariant results come from one tile width from position 0, whatever the config
    q, kc, vc, meta = make_batch([(300, 300), (90, 7)], 2, 2, 32, 8, torch.bfloat16, seed=3)
    narrow = replace(WIDE_PREFILL, wide_n=0)
    a = paged_attention_triton(q, kc, vc, meta, 0.2, batch_invariant=True, prefill_config=WIDE_PREFILL)
    b = paged_attention_triton(q, kc, vc, meta, 0.2, batch_invariant=True, prefill_config=narrow)
    assert torch.equal(a, b)
    c = paged_attention_triton(q, kc, vc, meta, 0.2, prefill_config=WIDE_PREFILL)
    assert not torch.equal(a, c)  # the wide tiles do change the rounding outside that mode


# ----------------------------------------------------------------------------- compiled for Hopper

def compile_launch_for_hopper(fn, args, kw):
    """One captured launch (`fn[grid](*args, **kw)`) compiled for sm_90 as the launcher would
    specialise it, without a GPU: (the CompiledKernel, its constexpr launch arguments, the
    compile options). Used by `compile_for_hopper` and `benchmarks/kernel_resources.py`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ty = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32", torch.int64: "*i64",
          torch.float8_e4m3fn: "*fp8e4nv"}
    kw = dict(kw, UPCAST=False) if "UPCAST" in kw else dict(kw)
    kw.pop("launch_pdl", None)
    if "USE_PDL" in kw:
        kw["USE_PDL"] = True  # the Hopper path: grid-dependency wait + launch of dependents
    # FP fusion on unless the launch says otherwise: the default of the GPU's Triton (3.6),
    # which Triton 3.10 turns off (a compile option, not an argument: the qkv epilogue's)
    opts = {"num_warps": kw.pop("num_warps", 4), "num_stages": kw.pop("num_stages", 3), "launch_pdl": True,
            "enable_fp_fusion": kw.pop("enable_fp_fusion", True)}
    # every argument by name: positional ones, keywords, and the defaults of the rest; the
    # constexpr parameters are constants, the others typed as the launcher would
    values = {p.name: p.default for p in fn.params if p.has_default}
    values.update(zip([n for n in fn.arg_names if n not in kw], args))
    values.update(kw)
    assert set(values) == set(fn.arg_names), set(fn.arg_names) ^ set(values)
    constexpr = {p.name for p in fn.params if p.is_constexpr}
    sig, attrs = {}, {}
    consts = {n: v for n, v in values.items() if n in constexpr or v is None}
    for n, v in values.items():
        if n in consts:
            continue
        i = fn.arg_names.index(n)
        if isinstance(v, torch.Tensor):
            sig[n] = ty[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[n] = "fp32"
        elif v == 1:
            consts[n] = 1  # the launcher specialises ints equal to 1
        else:
            sig[n] = "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    for n in consts:
        sig[n] = "constexpr"
    sig = {n: sig[n] for n in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options=opts)
    return compiled, {k: v for k, v in kw.items() if k.isupper()}, opts


@contextlib.contextmanager
def recorded_launches(module, names: list[str], launches: list):
    """Within: the Triton kernels `names` of `module` append their launches (kernel, args,
    kwargs) to `launches` instead of running, so that they can be compiled as launched
    (here, and `benchmarks/kernel_resources.py`)."""
    saved = {name: getattr(module, name) for name in names}

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((self.fn, args, kw))

    for name, fn in saved.items():
        setattr(module, name, Recorder(fn))
    try:
        yield launches
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def launch_every_kernel(ta, te, tf, tg) -> None:
    """Each kernel's launches as the host code makes them (8B shape, bf16 and fp32, and the
    0.6B shape where it differs): for compile_for_hopper, with the launches recorded."""
    for dtype in [torch.bfloat16, torch.float32]:
        lens = [8192] * 32
        # decode (split, merged in the kernel), decode (split + reduce pass), prefill, and a
        # mixed batch whose single-token rows take the decode kernel
        for max_q, counters, num_decode in [(1, True, 0), (1, False, 0), (8, True, 0), (8, True, 1)]:
            q, kc, vc, meta = make_batch([(s, 1) for s in lens[:2]], 8, 4, 128, 16, dtype, seed=0,
                                         counters=counters)
            meta = replace(meta, max_query_len=max_q, max_seq_len=8192, num_decode=num_decode)
            ta.paged_attention_triton(q, kc, vc, meta, 0.1)
    # the large-batch decode tiles (here from 2 rows on)
    q, kc, vc, meta = make_batch([(8192, 1)] * 2, 8, 4, 128, 16, torch.bfloat16, seed=0)
    ta.paged_attention_triton(q, kc, vc, meta, 0.1, decode_config=DecodeConfig(large_batch=1))
    # the decode kernel at the workloads' batch sizes: 32 rows on the 8B shape (seed-8b-short's
    # decode steps: default tiles, 256-token chunks), 1 and 32 rows on the 0.6B shape (2 q
    # heads a KV head)
    for rows, group in [(32, 4), (1, 2), (32, 2)]:
        q, kc, vc, meta = make_batch([(512, 1)] * rows, 8, group, 128, 16, torch.bfloat16, seed=0)
        ta.paged_attention_triton(q, kc, vc, meta, 0.1)
    # with the first KV tile loaded before the PDL wait (DecodeConfig.prefetch_batch)
    for rows, group in [(1, 2), (8, 4)]:
        q, kc, vc, meta = make_batch([(512, 1)] * rows, 8, group, 128, 16, torch.bfloat16, seed=0)
        ta.paged_attention_triton(q, kc, vc, meta, 0.1, decode_config=DecodeConfig(prefetch_batch=8))
    # with the qkv epilogue inside (DecodeConfig.epilogue_batch): one row of the 0.6B shape
    # with Qwen3's q/k norms and of the 8B shape's heads without, qkv finished by the GEMV
    from slipstream.ops.metadata import QKVEpilogue
    for group, norms in [(2, True), (4, False)]:
        q, kc, vc, meta = make_batch([(512, 1)], 8, group, 128, 16, torch.bfloat16, seed=0)
        qkv = torch.zeros(1, (8 * group + 16) * 128, dtype=torch.bfloat16)
        w = torch.ones(128, dtype=torch.bfloat16) if norms else None
        epi = QKVEpilogue(torch.zeros(1, dtype=torch.int32), build_cos_sin_cache(torch.ones(64), 64), w, w)
        ta.paged_attention_triton(qkv[:, :8 * group * 128].view(1, 8 * group, 128), kc, vc, meta, 0.1,
                                  epilogue=epi)
    # the verify kernel (speculative decoding, meta.verify_len = k + 1): the 8B shape at k = 4,
    # bf16 and fp32, its splits merged in the kernel and by the reduce pass; the 0.6B shape at
    # k = 7, one row; an FP8 cache at 32 rows; a sliding window
    for dtype in [torch.bfloat16, torch.float32]:
        for counters in (True, False):
            q, kc, vc, meta = make_batch([(8192, 5)] * 2, 8, 4, 128, 16, dtype, seed=0, counters=counters)
            ta.paged_attention_triton(q, kc, vc, replace(meta, verify_len=5, max_seq_len=8192), 0.1)
    q, kc, vc, meta = make_batch([(512, 8)], 8, 2, 128, 16, torch.bfloat16, seed=0)
    ta.paged_attention_triton(q, kc, vc, replace(meta, verify_len=8), 0.1)
    from slipstream.ops.kv_quant import FP8_DTYPE, KVScales
    q, kc, vc, meta = make_batch([(512, 5)] * 32, 8, 4, 128, 16, torch.bfloat16, seed=0)
    ta.paged_attention_triton(q, kc.to(FP8_DTYPE), vc.to(FP8_DTYPE), replace(meta, verify_len=5), 0.1,
                              kv_scales=KVScales(0.5, 0.25))
    q, kc, vc, meta = make_batch([(4096, 5)] * 2, 8, 4, 128, 16, torch.bfloat16, seed=0)
    ta.paged_attention_triton(q, kc, vc, replace(meta, verify_len=5), 0.1, window=1024)
    # the layer's other Triton kernels with the folded norms' row scale (8B shape, bf16):
    # the qkv epilogue (with q/k norms, and with a qkv bias), SiLU·mul, the final RMSNorm
    bf = torch.bfloat16
    T, D, H, inter = 32, 128, 4096, 14336
    h = torch.zeros(T, H, dtype=bf)
    cs = build_cos_sin_cache(torch.ones(D // 2), 64)
    pos, slots = torch.zeros(T, dtype=torch.int32), torch.arange(T, dtype=torch.int32)
    kc = torch.zeros(4, 16, 8, D, dtype=bf)
    norm_w = torch.ones(D, dtype=bf)
    te.qkv_epilogue_triton(torch.zeros(T, 48 * D, dtype=bf), pos, cs, kc, kc.clone(), slots, 32, 8, D,
                           norm_w, norm_w, 1e-5, hidden=h)
    te.qkv_epilogue_triton(torch.zeros(T, 48 * D, dtype=bf), pos, cs, kc, kc.clone(), slots, 32, 8, D,
                           eps=1e-5, hidden=h, bias=torch.zeros(48 * D, dtype=bf))
    te.qkv_epilogue_triton(torch.zeros(T, 48 * D, dtype=bf), pos, cs, kc, kc.clone(), slots, 32, 8, D,
                           norm_w, norm_w, 1e-5, hidden=h, prefetch_tokens=T)  # loads before the wait
    tf.silu_and_mul_triton(torch.zeros(T, 2 * inter, dtype=bf), hidden=h, eps=1e-5)
    tf.rms_norm_triton(h, torch.ones(H, dtype=bf), 1e-5)
    # the one-row GEMV (0.6B shape): plain, with the folded norm's row scale and a bias, and
    # with the SiLU·mul input into the residual
    h1 = torch.zeros(1, 1024, dtype=bf)
    tg.gemv(torch.zeros(1, 2048, dtype=bf), torch.zeros(1024, 2048, dtype=bf))
    tg.gemv(h1, torch.zeros(4096, 1024, dtype=bf), torch.zeros(4096, dtype=bf), row_scale_eps=1e-6)
    tg.gemv(torch.zeros(1, 6144, dtype=bf), torch.zeros(1024, 3072, dtype=bf), residual=h1, out=h1,
            silu_mul=True)
    # the streaming GEMV (8B shape, one row): qkv with the row scale, o into the residual,
    # down with the SiLU·mul input
    h8 = torch.zeros(1, 4096, dtype=bf)
    tg.gemv(h8, torch.zeros(6144, 4096, dtype=bf), row_scale_eps=1e-5)
    tg.gemv(torch.zeros(1, 4096, dtype=bf), torch.zeros(4096, 4096, dtype=bf), residual=h8, out=h8)
    tg.gemv(torch.zeros(1, 2 * 14336, dtype=bf), torch.zeros(4096, 14336, dtype=bf), residual=h8, out=h8,
            silu_mul=True)
    # the FP8 KV cache (kv_cache_dtype="fp8", 8B shape): decode at 32 rows, at one row with its
    # first tile before the PDL wait, prefill; the qkv epilogue's quantizing store
    from slipstream.ops.kv_quant import FP8_DTYPE, KVScales
    sc = KVScales(0.5, 0.25)
    for rows, cfg, max_q in [(32, None, 1), (1, DecodeConfig(prefetch_batch=8), 1), (2, None, 8)]:
        q, kc, vc, meta = make_batch([(512, 1)] * rows, 8, 4, 128, 16, bf, seed=0)
        ta.paged_attention_triton(q, kc.to(FP8_DTYPE), vc.to(FP8_DTYPE), replace(meta, max_query_len=max_q), 0.1,
                                  decode_config=cfg, kv_scales=sc)
    k8 = torch.zeros(4, 16, 8, D, dtype=FP8_DTYPE)
    te.qkv_epilogue_triton(torch.zeros(T, 48 * D, dtype=bf), pos, cs, k8, k8.clone(), slots, 32, 8, D,
                           norm_w, norm_w, 1e-5, hidden=h, kv_scales=sc)
    # and one row of the 0.6B shape with the qkv epilogue inside the decode kernel, storing FP8
    q, kc, vc, meta = make_batch([(512, 1)], 8, 2, 128, 16, bf, seed=0)
    qkv = torch.zeros(1, (16 + 16) * 128, dtype=bf)
    epi = QKVEpilogue(torch.zeros(1, dtype=torch.int32), build_cos_sin_cache(torch.ones(64), 64), norm_w, norm_w)
    ta.paged_attention_triton(qkv[:, :16 * 128].view(1, 16, 128), kc.to(FP8_DTYPE), vc.to(FP8_DTYPE), meta, 0.1,
                              epilogue=epi, kv_scales=sc)


def compile_for_hopper(ptx_dir: str | None = None) -> None:
    """Compile every kernel for sm_90 as the host code would launch it (8B shape; bf16 and
    fp32), without a GPU.  The interpreter runs kernels as Python, so it misses what only
    the compiler rejects (globals, types, shapes of dots).  Run in a process without
    TRITON_INTERPRET (see the test below).  ptx_dir: also write each compiled kernel's PTX
    there (`benchmarks/ptx_diff.py` compares two trees' with it)."""
    import slipstream.ops.triton_attention as ta
    import slipstream.ops.triton_fused as tf
    import slipstream.ops.triton_gemv as tg
    import slipstream.ops.triton_qkv_epilogue as te

    launches: list = []
    with contextlib.ExitStack() as stack:
        for module, names in [(ta, ["_decode_kernel", "_decode_reduce_kernel", "_prefill_kernel", "_verify_kernel",
                                    "_verify_reduce_kernel"]),
                              (te, ["_qkv_epilogue_kernel"]), (tf, ["_silu_and_mul_kernel", "_rms_norm_kernel"]),
                              (tg, ["_gemv_kernel", "_gemv_stream_kernel"])]:
            stack.enter_context(recorded_launches(module, names, launches))
        launch_every_kernel(ta, te, tf, tg)
    for fn, args, kw in launches:
        compiled, shown, opts = compile_launch_for_hopper(fn, args, kw)
        print("compiled", fn.__name__, shown)
        if ptx_dir:
            os.makedirs(ptx_dir, exist_ok=True)
            with open(os.path.join(ptx_dir, f"{len(os.listdir(ptx_dir)):03d}.ptx"), "w") as f:
                f.write(f"// {fn.__name__} {json.dumps(shown, sort_keys=True)} {json.dumps(opts, sort_keys=True)}\n")
                f.write(compiled.asm["ptx"])


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU every test compiles the kernels")
def test_kernels_compile_for_hopper():
    from helpers import run_hopper_compile
    out = run_hopper_compile(__file__, timeout=300)
    assert out.count("compiled") == 45, out


# ----------------------------------------------------------------------------- GPU, real sizes

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits", [None, 1, 16])
def test_gpu_decode_8b(dtype, splits):
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(1, 8193, (32,), generator=g).tolist()
    lens[0], lens[1], lens[2] = 8192, 0, 1
    seqs = [(s, 1) for s in lens]
    check_attention(seqs, 8, 4, 128, 16, dtype, seed=2, num_splits=splits)


@pytest.mark.gpu
def test_gpu_decode_graph_bound():
    # CUDA-graph style: max_seq_len = max model length, short real rows.
    seqs = [(s, 1) for s in [3, 100, 0, 700, 2049, 16]]
    check_attention(seqs, 8, 4, 128, 16, torch.bfloat16, seed=3, max_seq_len=131072,
                    extra_tokens=3)


@pytest.mark.gpu
@pytest.mark.parametrize("max_query_len", [1, 16])
def test_gpu_cuda_graph_replay(max_query_len):
    # Capture once with a max_model_len bound, then change the batch in place (lengths,
    # block tables, query layout) and replay: the graph must follow the new contents.
    qlen = max_query_len
    first = [(s, qlen) for s in [9000, 300, 17, 0]]
    q, kc, vc, meta = make_batch(first, 8, 4, 128, 16, torch.bfloat16, seed=8, max_seq_len=32768)
    out = torch.empty_like(q)
    paged_attention_triton(q, kc, vc, meta, 0.1, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention_triton(q, kc, vc, meta, 0.1, out=out)
    for seed, lens, qlens in [(9, [40, 3000, 0, 999], [qlen, 1, 2, qlen]),
                              (10, [7, 0, 8000, 64], [1, 0, qlen, 3])]:
        qlens = [min(x, qlen) for x in qlens]
        q2, kc2, vc2, meta2 = make_batch(list(zip(lens, qlens)), 8, 4, 128, 16, torch.bfloat16,
                                         seed=seed, max_seq_len=32768)
        assert q2.shape[0] <= q.shape[0] and kc2.shape[0] <= kc.shape[0]
        n = q2.shape[0]
        q.zero_()
        q[:n] = q2
        kc[:kc2.shape[0]] = kc2
        vc[:vc2.shape[0]] = vc2
        meta.seq_lens.copy_(meta2.seq_lens)
        meta.query_start_loc.copy_(meta2.query_start_loc)
        meta.block_table.zero_()
        meta.block_table[:, :meta2.block_table.shape[1]] = meta2.block_table
        out.fill_(float("nan"))
        graph.replay()
        expected = paged_attention_ref(q2, kc2, vc2, meta2, 0.1)
        torch.testing.assert_close(out[:n].float(), expected.float(), atol=2e-2, rtol=2e-2)
        assert (out[n:] == 0).all()  # tokens past the last sequence


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_mixed_8b(dtype):
    seqs = [(2048, 2048), (4096, 2048), (2300, 1000), (0, 5), (8192, 1), (513, 1), (77, 77)]
    check_attention(seqs, 8, 4, 128, 16, dtype, seed=4, extra_tokens=4)


@pytest.mark.gpu
@pytest.mark.parametrize("group,head_dim,block_size", [(1, 64, 32), (3, 128, 16), (8, 256, 8)])
def test_gpu_other_shapes(group, head_dim, block_size):
    decode = [(s, 1) for s in [1, 1000, 4097, 0, 33]]
    check_attention(decode, 2, group, head_dim, block_size, torch.bfloat16, seed=5, num_splits=4)
    mixed = [(600, 600), (1000, 17), (5, 1), (0, 0), (129, 128)]
    check_attention(mixed, 2, group, head_dim, block_size, torch.bfloat16, seed=6)


@pytest.mark.gpu
@pytest.mark.parametrize("inside", [False, True])
@pytest.mark.parametrize("prefetch", [0, 8])
@pytest.mark.parametrize("lens", [[1], [64], [65], [300], [1000], [129, 64, 1, 700]])
def test_gpu_decode_after_the_epilogue_reads_the_newest_position(lens, prefetch, inside):
    """The engine's chain at small batches: the qkv epilogue stores each row's newest K/V and
    the decode kernel, launched right after it with PDL, must read them (a decode kernel
    that loaded its KV before waiting for the epilogue would not). Captured as the engine
    runs it (epilogue, then attention, in one graph) with the newest slots poisoned before
    every replay: a stale read of that position gives NaN.  prefetch: the decode kernel
    loads the rest of its first tile before the wait (DecodeConfig.prefetch_batch).  inside:
    the decode kernel does the epilogue's work itself, so its own store of the newest K/V
    must come before its own reads of them."""
    from slipstream.ops.fused import build_cos_sin_cache, qkv_epilogue, qkv_epilogue_ref
    kvh, group, d, bs = 8, 2, 128, 16
    q, kc, vc, meta = make_batch([(n, 1) for n in lens], kvh, group, d, bs, torch.bfloat16, seed=21,
                                 max_seq_len=4096)
    rows = len(lens)
    newest = torch.tensor([int(meta.block_table[r, (n - 1) // bs]) * bs + (n - 1) % bs
                           for r, n in enumerate(lens)], dtype=torch.int32, device=DEVICE)
    meta = replace(meta, slot_mapping=newest)
    positions = torch.tensor([n - 1 for n in lens], dtype=torch.int32, device=DEVICE)
    cos_sin = build_cos_sin_cache(1.0 / (10000 ** (torch.arange(0, d, 2, device=DEVICE) / d)), 4096)
    qkv = torch.randn(rows, (kvh * group + 2 * kvh) * d, device=DEVICE).to(torch.bfloat16)
    qkv_in = torch.empty_like(qkv)
    out = torch.empty(rows, kvh * group, d, dtype=torch.bfloat16, device=DEVICE)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_ref = qkv_epilogue_ref(qkv, positions, cos_sin, kc_ref, vc_ref, newest, kvh * group, kvh, d)
    expected = paged_attention_ref(q_ref, kc_ref, vc_ref, meta, d ** -0.5)

    cfg = DecodeConfig(prefetch_batch=prefetch)

    def step():
        qkv_in.copy_(qkv)  # the epilogue writes q into its input
        if inside:
            raw_q = qkv_in[:, :kvh * group * d].view(rows, kvh * group, d)
            paged_attention_triton(raw_q, kc, vc, meta, d ** -0.5, out=out, decode_config=cfg,
                                   epilogue=QKVEpilogue(positions, cos_sin))
            return
        qq = qkv_epilogue(qkv_in, positions, cos_sin, kc, vc, newest, kvh * group, kvh, d)
        paged_attention_triton(qq, kc, vc, meta, d ** -0.5, out=out, decode_config=cfg)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    blk, off = newest.long() // bs, newest.long() % bs
    for _ in range(20):
        kc[blk, off] = float("nan")
        vc[blk, off] = float("nan")
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), "the newest position was read before the epilogue wrote it"
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)

@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["qwen3-0.6b", "llama-3.1-8b"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_gpu_epilogue_inside_real_shapes(shape, rows):
    """Small decode batches with the epilogue inside the decode kernel on the two benchmark
    shapes' heads (Qwen3-0.6B: 2 q heads a KV head, q/k norms; Llama-3.1-8B: 4), long and
    short rows, against the two-kernel path and the torch references."""
    group, norms = (2, True) if shape == "qwen3-0.6b" else (4, False)
    check_epilogue_inside([4096, 1, 700, 129, 64, 2000, 3, 513][:rows], 8, group, 128, 16, torch.bfloat16,
                          seed=90 + rows, norms=norms, equal=False, max_seq_len=8192)


if __name__ == "__main__" and "--compile-for-hopper" in sys.argv:
    compile_for_hopper(sys.argv[sys.argv.index("--ptx-dir") + 1] if "--ptx-dir" in sys.argv else None)


# ----------------------------------------------------------------------------- verify

def check_verify(seqs, num_kv_heads, group, q_len, *, dtype=torch.float32, block_size=8, seed=0,
                 splits=None, order=True, counters=True, window=None, extra_tokens=0):
    """The verify kernel (meta.verify_len = q_len) against the reference; rows of seqs have
    1..q_len query tokens."""
    q, kc, vc, meta = make_batch(seqs, num_kv_heads, group, 32, block_size, dtype, seed=seed,
                                 order=order, counters=counters, extra_tokens=extra_tokens)
    meta = replace(meta, verify_len=q_len)
    scale = 32 ** -0.5
    expected = paged_attention_ref(q, kc, vc, meta, scale, window)
    out = torch.full_like(q, float("nan"))
    paged_attention_triton(q, kc, vc, meta, scale, out=out, decode_config=SMALL_DECODE, num_splits=splits,
                           window=window)
    assert not torch.isnan(out).any(), "unwritten or NaN-contaminated output"
    atol, rtol = tolerances(dtype)
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    if counters:
        assert (meta.split_counters == 0).all()
    return out


@pytest.mark.slow
@pytest.mark.quick_sample(1)
@pytest.mark.parametrize("k", [3, 1, 2, 4, 5, 6, 7])
def test_verify_kernel_k_query_tokens_a_row(k):
    """k + 1 query tokens a row (GQA, 4 heads a KV head), rows across block and tile
    boundaries, a padding row, several splits merged in the kernel."""
    q_len = k + 1
    seqs = [(q_len, q_len), (15 + q_len, q_len), (16, q_len), (33 + k, q_len), (0, q_len), (64, q_len)]
    check_verify(seqs, 2, 4, q_len, seed=k, splits=3)


@pytest.mark.quick_sample(1)
@pytest.mark.parametrize("group,splits", [(3, 2), (1, 1), (1, 4), (8, None)])
def test_verify_kernel_mha_and_gqa_groups(group, splits):
    check_verify([(9, 4), (40, 4), (17, 4)], 2, group, 4, seed=group, splits=splits)


def test_verify_kernel_rows_with_fewer_drafts():
    """A row of a verify batch with fewer drafts has fewer query tokens: each query still
    sits at seq_len - n + i."""
    check_verify([(20, 1), (31, 5), (18, 3), (50, 2)], 1, 4, 5, seed=3, splits=2)


@pytest.mark.quick_sample(1)
@pytest.mark.parametrize("order,counters", [(False, False), (True, False), (False, True)])
def test_verify_kernel_reduce_pass_and_row_order(order, counters):
    check_verify([(9, 3), (70, 3), (1 + 2, 3)], 2, 2, 3, seed=7, splits=4, order=order, counters=counters,
                 extra_tokens=2)


@pytest.mark.quick_sample(1)
@pytest.mark.parametrize("window", [4, 16])
def test_verify_kernel_sliding_window(window):
    check_verify([(5, 4), (40, 4), (23, 4)], 1, 2, 4, seed=11, splits=2, window=window)


def test_verify_kernel_bf16():
    check_verify([(40, 8), (19, 8)], 2, 4, 8, dtype=torch.bfloat16, seed=5, splits=2)


def test_verify_kernel_fp8_cache():
    from slipstream.ops.kv_quant import KVScales
    q, kc, vc, meta = make_batch([(30, 4), (9, 4)], 1, 4, 32, 8, torch.float32, seed=2)
    meta = replace(meta, verify_len=4)
    sc = KVScales(0.05, 0.04)
    kc8 = (kc.nan_to_num(0.0) / sc.k_scale).to(torch.float8_e4m3fn)
    vc8 = (vc.nan_to_num(0.0) / sc.v_scale).to(torch.float8_e4m3fn)
    expected = paged_attention_ref(q, kc8, vc8, meta, 32 ** -0.5, kv_scales=sc)
    out = paged_attention_triton(q, kc8, vc8, meta, 32 ** -0.5, decode_config=SMALL_DECODE, num_splits=2,
                                 kv_scales=sc)
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)


def test_verify_kernel_graph_layout_pads_rows_to_k_plus_1():
    """A graph's verify layout: every row k + 1 tokens, padding rows of seq_len 0 (zeros),
    trailing tokens past the last row (zeros)."""
    out = check_verify([(12, 3), (0, 3), (29, 3), (0, 3)], 2, 2, 3, seed=9, splits=2, extra_tokens=3)
    assert (out[3:6] == 0).all() and (out[9:] == 0).all()
