"""Dequantization of GGUF's plain block formats (Q4_0, Q4_1, Q8_0) in torch, and of a
slice of a tensor only.

`gguf.quants.dequantize` is the reference; it works in numpy over groups of 16 rows.  This
does the same float32 operations in the same order in torch, so the result is bit for bit
the reference's (tests/test_gguf_dequant.py), in less time: every tensor of the embedded
SmolLM2 (Q4_1, one Q8_0, F32) 1.19-1.62 s -> 0.50-0.57 s on a 2-core CPU
(benchmarks/bench_gguf_load.py).  Other types
(the K-quants, ...) go to the reference.

A block of 32 weights along a row is stored as one or two float16 scales and the packed
values; a row is a whole number of blocks, so a row range, or a column range aligned to
blocks, is a byte range of the raw tensor: a tensor-parallel rank dequantizes its slice
of a tensor, not the whole of it (`dequantize`'s `rows` / `cols`).
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

BLOCK = 32
# the types done here, and the bytes of one block of each (scale(s) + values), as gguf has them
_TYPE_SIZES = {name: GGML_QUANT_SIZES[GGMLQuantizationType[name]][1] for name in ("Q4_0", "Q4_1", "Q8_0")}


def supported(qtype_name: str) -> bool:
    return qtype_name in _TYPE_SIZES


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """[n, 16] uint8 -> [n, 32]: the low nibbles are a block's first 16 values, the high its last 16."""
    return torch.cat([q & 0x0F, q >> 4], dim=1)


def _fp16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).to(torch.float32)


def _blocks(qtype_name: str, b: torch.Tensor) -> torch.Tensor:
    """[n, type size] uint8 blocks -> [n, 32] float32, in the reference's operation order."""
    if qtype_name == "Q8_0":
        return b[:, 2:].contiguous().view(torch.int8).to(torch.float32) * _fp16(b[:, 0:2])
    if qtype_name == "Q4_0":
        return _fp16(b[:, 0:2]) * (_nibbles(b[:, 2:]).to(torch.int8) - 8).to(torch.float32)
    return _fp16(b[:, 0:2]) * _nibbles(b[:, 4:]).to(torch.float32) + _fp16(b[:, 2:4])


def dequantize(raw: np.ndarray, qtype_name: str, shape: tuple[int, ...],
               rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
    """Tensor of `shape` stored as `raw` (uint8, the tensor's bytes) -> float32, or only its
    rows [start, start + length) and / or columns [start, start + length) (the last dim;
    start and length multiples of 32)."""
    type_size = _TYPE_SIZES[qtype_name]
    width = shape[-1] if shape else 1
    if width % BLOCK:
        raise ValueError(f"{qtype_name} tensor of shape {shape}: its rows are not whole blocks of {BLOCK}")
    with warnings.catch_warnings():  # the mapped file is read-only; nothing here writes to it
        warnings.simplefilter("ignore", UserWarning)
        table = torch.from_numpy(raw).view(-1, width // BLOCK * type_size)  # one tensor row a row
    lead = tuple(shape[:-1])
    if rows is not None:
        if len(shape) != 2:
            raise ValueError(f"a row range of a {len(shape)}-d tensor (shape {shape})")
        table = table[rows[0]:rows[0] + rows[1]]
        lead = (table.shape[0],)
    if cols is not None:
        start, length = cols
        if start % BLOCK or length % BLOCK:
            raise ValueError(f"columns [{start}, {start + length}) are not whole blocks of {BLOCK}")
        table = table[:, start // BLOCK * type_size:(start + length) // BLOCK * type_size]
        width = length
    values = _blocks(qtype_name, table.reshape(-1, type_size))
    return values.reshape(*lead, width) if shape else values.reshape(())
