"""Sliding-window attention: the Triton kernels (TRITON_INTERPRET=1 on the CPU) against the
torch reference, and the reference against a dense mask written out by hand.

A window W lets the query at position p see keys (p - W, p].  The kernels run on a cache
whose blocks behind every query's window are poisoned with NaN (the scheduler may have
freed and reused them): a kernel that reads one fails; the reference runs on the clean cache.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_attention_kernels import (DEVICE, SMALL_DECODE, SMALL_PREFILL, attention_with_epilogue_inside,
                                    epilogue_case, epilogue_then_attention, make_batch, tolerances)

from slipstream.ops.attention import paged_attention_ref
from slipstream.ops.attention_tuning import PrefillConfig
from slipstream.ops.fused import qkv_epilogue_ref
from slipstream.ops.triton_attention import paged_attention_triton


def _poison_behind_window(seqs, k_cache, v_cache, meta, block_size, window):
    """NaN into every block all of whose positions lie below the first query's window."""
    k, v = k_cache.clone(), v_cache.clone()
    for r, (seq_len, q_len) in enumerate(seqs):
        if seq_len == 0:
            continue
        oldest = max(seq_len - q_len + 1 - window, 0)  # the first query's oldest key
        for j in range(oldest // block_size):
            b = int(meta.block_table[r, j])
            k[b], v[b] = float("nan"), float("nan")
    return k, v


def check_window(seqs, window, *, num_kv_heads=2, group=2, head_dim=32, block_size=8,
                 dtype=torch.float32, seed=0, **kwargs):
    q, k_cache, v_cache, meta = make_batch(seqs, num_kv_heads, group, head_dim, block_size, dtype, seed=seed)
    scale = head_dim ** -0.5
    expected = paged_attention_ref(q, k_cache, v_cache, meta, scale, window)
    k_bad, v_bad = _poison_behind_window(seqs, k_cache, v_cache, meta, block_size, window)
    out = torch.full_like(q, float("nan"))
    paged_attention_triton(q, k_bad, v_bad, meta, scale, out=out, window=window, **kwargs)
    assert not torch.isnan(out).any(), "a key behind the window was read, or an output left unwritten"
    atol, rtol = tolerances(dtype)
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    return expected


def test_reference_window_matches_a_dense_mask():
    seqs = [(23, 9)]
    q, k_cache, v_cache, meta = make_batch(seqs, 1, 2, 16, 4, torch.float32, seed=1, device="cpu")
    window, scale = 5, 0.25
    got = paged_attention_ref(q, k_cache, v_cache, meta, scale, window)
    k = k_cache[meta.block_table[0, :6].long()].reshape(-1, 1, 16)[:23, 0]
    v = v_cache[meta.block_table[0, :6].long()].reshape(-1, 1, 16)[:23, 0]
    q_pos, k_pos = torch.arange(14, 23)[:, None], torch.arange(23)[None, :]
    allowed = (k_pos <= q_pos) & (k_pos > q_pos - window)  # transformers' sliding-window mask
    for h in range(2):
        scores = (q[:, h] @ k.T * scale).masked_fill(~allowed, float("-inf"))
        torch.testing.assert_close(got[:, h], scores.softmax(-1) @ v)
    # a window at least as long as the context is full attention
    torch.testing.assert_close(paged_attention_ref(q, k_cache, v_cache, meta, scale, 23),
                               paged_attention_ref(q, k_cache, v_cache, meta, scale))


DECODE_SEQS = [(1, 1), (9, 1), (0, 1), (16, 1), (17, 1), (50, 1), (70, 1)]


@pytest.mark.slow
@pytest.mark.quick_sample(2)
@pytest.mark.parametrize("window,splits", [(5, 1), (20, 3), (33, None), (200, 2)])
def test_decode_window(window, splits):
    # windows shorter than every row, between, and longer than every context
    check_window(DECODE_SEQS, window, decode_config=SMALL_DECODE, num_splits=splits)


@pytest.mark.slow
def test_decode_window_with_prefetched_first_tile():
    # small batches load their first tile before the PDL wait: it starts at the window's start
    check_window(DECODE_SEQS, 21, decode_config=replace(SMALL_DECODE, prefetch_batch=8), num_splits=2)


@pytest.mark.slow
def test_decode_window_without_split_counters_bf16():
    # the separate merge pass counts a row's splits over its window
    q, k_cache, v_cache, meta = make_batch(DECODE_SEQS, 2, 4, 32, 8, torch.bfloat16, seed=4,
                                           order=False, counters=False)
    expected = paged_attention_ref(q, k_cache, v_cache, meta, 0.2, 12)
    out = paged_attention_triton(q, k_cache, v_cache, meta, 0.2, window=12, decode_config=SMALL_DECODE,
                                 num_splits=4)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


PREFILL_SEQS = [(40, 40), (37, 19), (9, 1), (0, 1), (64, 3), (30, 30)]


@pytest.mark.slow
@pytest.mark.quick_sample(2)
@pytest.mark.parametrize("window", [1, 6, 17, 100])
def test_prefill_window_over_cached_prefix(window):
    # rows 1 and 4 have a cached prefix; a window smaller and larger than a query tile
    check_window(PREFILL_SEQS, window, prefill_config=SMALL_PREFILL)


@pytest.mark.slow
def test_prefill_window_with_wide_tiles():
    wide = PrefillConfig(block_m=16, block_n=16, wide_n=32, num_warps=1, num_stages=1)
    check_window([(90, 70), (75, 2), (40, 40)], 45, prefill_config=wide)


def test_mixed_batch_window_decode_rows_in_the_decode_kernel():
    seqs = [(60, 1), (45, 20), (33, 1), (12, 12)]
    q, k_cache, v_cache, meta = make_batch(seqs, 2, 2, 32, 8, torch.float32, seed=7)
    meta.num_decode = 2  # rows 0 and 2, longest first in decode_order
    meta.decode_order = torch.tensor([0, 2, 1, 3], dtype=torch.int32, device=q.device)
    expected = paged_attention_ref(q, k_cache, v_cache, meta, 0.3, 10)
    k_bad, v_bad = _poison_behind_window(seqs, k_cache, v_cache, meta, 8, 10)
    out = paged_attention_triton(q, k_bad, v_bad, meta, 0.3, window=10, decode_config=SMALL_DECODE,
                                 prefill_config=SMALL_PREFILL, num_splits=2)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_batch_invariant_window_decode_through_the_prefill_kernel():
    check_window(DECODE_SEQS, 13, prefill_config=SMALL_PREFILL, batch_invariant=True)


@pytest.mark.slow
@pytest.mark.quick_sample(1)
@pytest.mark.parametrize("prefetch", [0, 8])
def test_decode_window_with_the_epilogue_inside(prefetch):
    # one kernel for the qkv epilogue and attention (small decode batches): the newest
    # position's K/V are stored by the split that holds it, inside the window
    lens = [0, 1, 7, 9, 17, 50]
    qkv, epi, kc, vc, meta = epilogue_case(lens, 2, 2, 16, 8, torch.float32, seed=90, norms=True)
    kw = dict(window=11, decode_config=replace(SMALL_DECODE, prefetch_batch=prefetch), num_splits=2)
    kc2, vc2 = kc.clone(), vc.clone()
    two = epilogue_then_attention(qkv, epi, kc2, vc2, meta, 4, **kw)
    one = attention_with_epilogue_inside(qkv, epi, kc, vc, meta, 4, **kw)
    assert not torch.isnan(one).any()
    q_ref = qkv_epilogue_ref(qkv, epi.positions, epi.cos_sin_cache, kc2.clone(), vc2.clone(), meta.slot_mapping,
                             4, 2, 16, epi.q_norm_weight, epi.k_norm_weight, epi.eps)
    torch.testing.assert_close(one, paged_attention_ref(q_ref, kc2, vc2, meta, 0.25, 11), atol=2e-5, rtol=2e-5)
    if DEVICE == "cpu":  # bit for bit under the interpreter
        assert torch.equal(one, two)
