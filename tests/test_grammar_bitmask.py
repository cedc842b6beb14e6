"""The token bitmask helpers: allocation, rows all allowed or allowing a few tokens, the
allowed ids of a row, and the torch reference that masks logits (no grammar library)."""
import pytest
import torch

from slipstream.sampling.grammar.bitmask import (
    allocate_bitmask,
    allowed_token_ids,
    apply_bitmask_ref,
    bitmask_width,
    fill_all_allowed,
    fill_only_allowed,
    forbid_tokens,
)


def test_bitmask_helpers():
    assert bitmask_width(64) == 2 and bitmask_width(65) == 3
    bitmask = allocate_bitmask(4, 70)
    assert bitmask.dtype == torch.int32 and bitmask.shape == (4, 3) and (bitmask == -1).all()
    fill_only_allowed(bitmask, 0, [0, 31, 69])
    fill_only_allowed(bitmask, 2, [])
    assert allowed_token_ids(bitmask, 0, 70).tolist() == [0, 31, 69]
    assert allowed_token_ids(bitmask, 1, 70).tolist() == list(range(70))
    assert allowed_token_ids(bitmask, 2, 70).tolist() == []
    fill_all_allowed(bitmask, [2])
    assert (bitmask[2] == -1).all()
    fill_only_allowed(bitmask, 3, [1])
    fill_all_allowed(bitmask, slice(3, 4))
    assert (bitmask == -1).sum() == 9
    fill_all_allowed(bitmask)
    assert (bitmask == -1).all()
    with pytest.raises(ValueError, match="max_rows >= 1"):
        allocate_bitmask(0, 70)


def test_forbid_tokens_and_the_row_that_can_only_stop():
    bitmask = allocate_bitmask(3, 70)
    assert forbid_tokens(bitmask, 0, [2, 31, 69])  # bit 31 is the int32 word's sign bit
    assert allowed_token_ids(bitmask, 0, 70).tolist() == [i for i in range(70) if i not in (2, 31, 69)]
    fill_only_allowed(bitmask, 1, [2, 31])
    assert not forbid_tokens(bitmask, 1, [2, 31], keep_if_only=True)  # nothing else: kept
    assert allowed_token_ids(bitmask, 1, 70).tolist() == [2, 31]
    fill_only_allowed(bitmask, 2, [2, 40])
    assert forbid_tokens(bitmask, 2, [2, 31], keep_if_only=True)  # 40 remains
    assert allowed_token_ids(bitmask, 2, 70).tolist() == [40]
    assert forbid_tokens(bitmask, 1, [2, 31])  # without keep_if_only: an empty row
    assert allowed_token_ids(bitmask, 1, 70).tolist() == []


def test_apply_bitmask_ref():
    logits = torch.randn(3, 100)  # wider than the 70-token bitmask's 96 bits
    bitmask = allocate_bitmask(3, 70)
    fill_only_allowed(bitmask, 0, [0, 31, 69])
    fill_only_allowed(bitmask, 2, [5])
    masked = apply_bitmask_ref(logits.clone(), bitmask)
    for row, allowed in ((0, {0, 31, 69}), (1, set(range(96))), (2, {5})):
        for token_id in range(100):
            expected = logits[row, token_id] if token_id in allowed else float("-inf")
            assert masked[row, token_id] == expected
    with pytest.raises(ValueError, match="same rows"):
        apply_bitmask_ref(logits, bitmask[:2])
