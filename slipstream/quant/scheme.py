"""Fp8Scheme: how a model's linear layers hold FP8 weights, whatever format they came in.

A checkpoint's `quantization_config` (compressed-tensors, fbgemm_fp8, fp8) or
`--quantization fp8` on a bf16/fp16 checkpoint becomes one of these; the loader reads the
checkpoint's scale tensors through `checkpoint_scale` into the one internal layout of
`quant/fp8.py` (scales that multiply; [N] per tensor / per channel, [N / bn, K / bk] per block).
Which layers: the decoder's q/k/v/o and gate/up/down; embeddings and the LM head stay in
the model's dtype (as vLLM does).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GRANULARITIES = ("tensor", "channel", "block")
# the projections an FP8 scheme quantizes (their Hugging Face names' last part)
QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Fp8Scheme:
    method: str  # where it came from: "fp8", "compressed-tensors", "fbgemm_fp8"
    granularity: str  # of the checkpoint's weight scales: "tensor", "channel" or "block"
    serialized: bool  # the checkpoint's weights are FP8 (False: quantized at load, per channel)
    block: tuple[int, int] | None = None  # (rows, columns) of a scale block
    scale_name: str = "weight_scale"  # the checkpoint tensor beside each `weight`
    # activation tensors some checkpoints carry, read by nothing: activations are quantized
    # dynamically per token (per token and K-block for block weights)
    skipped_suffixes: tuple[str, ...] = ("input_scale", "input_scale_ub")

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"FP8 weight scales per {self.granularity!r}: supported {', '.join(GRANULARITIES)}")
        if (self.granularity == "block") != (self.block is not None):
            raise ValueError("FP8 block scales need a block size (weight_block_size), and only they")

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int] | tuple[int]:
        """Shape of a layer's internal scale for a [rows, cols] weight."""
        if self.block is None:
            return (rows,)
        return (-(-rows // self.block[0]), -(-cols // self.block[1]))

    def weight_bytes(self, rows: int, cols: int) -> int:
        """Bytes a product reads of a [rows, cols] weight in this scheme: one a value, four a
        float32 scale (the bench floors count them: bench/throughput.py)."""
        scales = 1
        for d in self.scale_shape(rows, cols):
            scales *= d
        return rows * cols + 4 * scales

    def checkpoint_scale(self, name: str, t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """A checkpoint's scale tensor for a [rows, cols] weight as the internal float32 scale
        (whole tensor, before any tensor-parallel slicing); a shape that does not fit is a
        ValueError naming the tensor."""
        t = t.float()
        if self.block is not None:
            want = self.scale_shape(rows, cols)
            if tuple(t.shape) != want:
                raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {want} "
                                 f"(block scales of {self.block[0]}x{self.block[1]} for a [{rows}, {cols}] weight)")
            return t
        flat = t.reshape(-1)
        if self.granularity == "tensor" and flat.numel() == 1:
            return flat.expand(rows).contiguous()
        if self.granularity == "channel" and flat.numel() == rows and t.dim() <= 2 and t.shape[0] == rows:
            return flat.contiguous()
        want = "one value" if self.granularity == "tensor" else f"[{rows}, 1] or [{rows}]"
        raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {want} "
                         f"(per-{self.granularity} scales)")


def check_ignored(method: str, names: list[str] | tuple[str, ...]) -> None:
    """Modules a checkpoint keeps unquantized: the LM head and embeddings are unquantized here
    anyway; a decoder projection kept in high precision is not supported (one ValueError)."""
    for name in names or ():
        if any(proj in name for proj in QUANTIZED_LINEARS) or name.rstrip("$").endswith((".mlp", ".self_attn")):
            raise ValueError(f"quantization_config ({method}) keeps {name!r} unquantized: mixing FP8 and "
                             "unquantized decoder layers is not supported")
