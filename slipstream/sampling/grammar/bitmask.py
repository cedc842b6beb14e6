"""The token bitmask: one int32 row of ceil(vocab_size / 32) words per sampling row; bit
``t % 32`` of word ``t // 32`` set means token t is allowed. A row of all ones (-1 words)
constrains nothing. `apply_bitmask_ref` is the torch reference the fused sampler matches:
a disallowed token's logit becomes -inf, and so does every logit column past the bitmask.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "allocate_bitmask",
    "allowed_token_ids",
    "apply_bitmask_ref",
    "bitmask_width",
    "fill_all_allowed",
    "fill_only_allowed",
    "forbid_tokens",
]

_ALL_ALLOWED = -1  # an int32 word with all 32 bits set


def bitmask_width(vocab_size: int) -> int:
    """Words per row for a vocabulary of `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def allocate_bitmask(max_rows: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """A CPU int32 bitmask of `max_rows` rows, all allowed; pinned memory (CUDA only) lets its
    copy to the device run asynchronously."""
    if max_rows < 1 or vocab_size < 1:
        raise ValueError(f"a bitmask needs max_rows >= 1 and vocab_size >= 1, "
                         f"got {max_rows} and {vocab_size}")
    bitmask = torch.empty((max_rows, bitmask_width(vocab_size)), dtype=torch.int32,
                          pin_memory=pin_memory)
    return bitmask.fill_(_ALL_ALLOWED)


def fill_all_allowed(bitmask: torch.Tensor, rows: Sequence[int] | slice | None = None) -> None:
    """Marks `rows` (all rows if None) as unconstrained."""
    if rows is None:
        bitmask.fill_(_ALL_ALLOWED)
    elif isinstance(rows, slice):
        bitmask[rows].fill_(_ALL_ALLOWED)
    elif len(rows):
        # numpy's fancy assignment on a CPU mask: one thread, ~6x faster than torch's index_put
        # (which goes through the intra-op pool) for half of a 256-row, 151,936-wide mask
        if bitmask.device.type == "cpu":
            bitmask.numpy()[np.asarray(rows, dtype=np.int64)] = _ALL_ALLOWED
        else:
            bitmask[torch.as_tensor(rows, dtype=torch.long, device=bitmask.device)] = _ALL_ALLOWED


def fill_only_allowed(bitmask: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    """Row `row` allows exactly `token_ids`."""
    words = torch.zeros(bitmask.shape[1], dtype=torch.int64)
    for token_id in token_ids:
        words[token_id // 32] |= 1 << (token_id % 32)
    # the words as unsigned 32-bit values, stored as int32 (bit 31 is the sign)
    bitmask[row] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def forbid_tokens(bitmask: torch.Tensor, row: int, token_ids: Sequence[int], keep_if_only: bool = False) -> bool:
    """Clears the bits of `token_ids` in row `row` of a CPU bitmask; with `keep_if_only` the row
    is left as it is when those tokens are all it allows (a grammar that can only stop).
    Returns whether the bits were cleared."""
    words = bitmask[row].numpy().view(np.uint32)
    ids = np.asarray(token_ids, dtype=np.int64)
    ids = ids[(ids >= 0) & (ids < 32 * words.size)]
    cleared = words.copy()
    np.bitwise_and.at(cleared, ids // 32, ~np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
    if keep_if_only and not cleared.any():
        return False
    words[:] = cleared
    return True


def _bits(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, width] bools: token t's bit of each row."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    bits = bits.reshape(bitmask.shape[0], -1).bool()
    if bits.shape[1] >= width:
        return bits[:, :width]
    pad = torch.zeros((bits.shape[0], width - bits.shape[1]), dtype=torch.bool, device=bits.device)
    return torch.cat([bits, pad], dim=1)


def allowed_token_ids(bitmask: torch.Tensor, row: int, vocab_size: int) -> torch.Tensor:
    """The token ids row `row` of a CPU bitmask allows, ascending (int64)."""
    # numpy unpacks bits ~20x faster than torch's shifts on the CPU; a little-endian int32
    # word's bytes, each read from its low bit, give its bits in token order
    words = bitmask[row].contiguous().numpy().astype("<i4", copy=False)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size]
    return torch.from_numpy(np.flatnonzero(bits))


def apply_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Sets logits[i, t] to -inf where row i of `bitmask` does not allow t; in place, returns
    `logits`. `logits` is [rows, logits_width], `bitmask` [rows, words] on the same device."""
    if logits.shape[0] != bitmask.shape[0]:
        raise ValueError(f"logits and bitmask need the same rows, got {logits.shape[0]} "
                         f"and {bitmask.shape[0]}")
    allowed = _bits(bitmask, logits.shape[1])
    return logits.masked_fill_(~allowed, float("-inf"))
