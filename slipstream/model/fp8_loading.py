"""Loading the FP8 layers of a model (model/fp8_layers.py) from a checkpoint, tensor by tensor.

Two cases, per tensor of an FP8 layer:
- FP8 in the checkpoint (the scheme is `serialized`): the weight's slice is copied as it is, and
  the scale tensor beside it (`weight_scale`, `weight_scale_inv`) is converted to the internal
  layout (quant/fp8.py) and sliced the same way;
- high precision (bf16/fp16 checkpoints with `quantization="fp8"`, GGUF, dummy weights): the
  whole tensor is read and quantized in the scheme's granularity (per channel for
  `--quantization fp8`), and the rank keeps its slice of the values and of the scales. Whole,
  so that a row-parallel rank's per-channel scales are those of the full rows: tensor-parallel
  ranks hold exactly the one-rank model's values.

Under tensor parallelism the scales follow their weights (model/shards.py): column-parallel
layers (q/k/v, gate/up) keep their rows' scales, row-parallel ones (o, down) keep all of
them per channel, and block scales split by blocks (a slice must start and end on a block).
"""
from __future__ import annotations

from typing import Callable

import torch

from slipstream.model.shards import Slice, full_shape, shard_slice, take
from slipstream.quant.fp8 import FP8_DTYPE, quantize_blocks, quantize_per_channel, quantize_per_tensor
from slipstream.quant.scheme import Fp8Scheme

SCALE_PARAM = "weight_scale"


def quantize(t: torch.Tensor, scheme: Fp8Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole high-precision weight in `scheme`'s granularity: (q, internal scale)."""
    if scheme.granularity == "block":
        return quantize_blocks(t, scheme.block)
    if scheme.granularity == "tensor":
        return quantize_per_tensor(t)
    return quantize_per_channel(t)


class Fp8Loading:
    """The FP8 part of `loader.load_weights`: which checkpoint tensors it takes and where they go.

    expected: the loader's table, HF name -> (our parameter, row offset or None, rows)."""

    def __init__(self, scheme: Fp8Scheme, params: dict[str, torch.nn.Parameter],
                 expected: dict[str, tuple[str, int | None, int]], shard, where: str):
        self.scheme, self.params, self.expected, self.shard, self.where = scheme, params, expected, shard, where
        # HF weight names of FP8 layers
        self.weights = {hf for hf, (pname, _, _) in expected.items() if params[pname].dtype == FP8_DTYPE}
        prefix = {hf.removesuffix(".weight") for hf in self.weights}
        self.scales = {f"{p}.{scheme.scale_name}": f"{p}.weight" for p in prefix} if scheme.serialized else {}
        self.skipped = {f"{p}.{s}" for p in prefix for s in scheme.skipped_suffixes}

    def scale_names(self) -> list[str]:
        """The scale tensors the checkpoint must hold (none when quantizing at load)."""
        return list(self.scales)

    def take(self, name: str, shape: tuple[int, ...], load: Callable) -> bool:
        """Load `name` if it belongs to an FP8 layer (True), else leave it to the loader."""
        if name in self.skipped:
            return True
        if name in self.scales:
            wname = self.scales[name]
            rows, cols = self._full_weight_shape(wname)
            self._store_scale(wname, self.scheme.checkpoint_scale(name, load(None), rows, cols))
            return True
        if name not in self.weights:
            return False
        pname, offset, rows = self.expected[name]
        param = self.params[pname]
        part = shard_slice(name, self.shard)
        want = full_shape((rows, param.shape[1]), part)
        if tuple(shape) != want:
            raise ValueError(f"{self.where}: tensor {name!r} has shape {tuple(shape)}, expected {want}")
        dest = param.data if offset is None else param.data.narrow(0, offset, rows)
        if self.scheme.serialized:
            t = load(part)
            if t.dtype == torch.uint8:  # FP8 bytes stored without their type
                t = t.view(FP8_DTYPE)
            if t.dtype != FP8_DTYPE:
                raise ValueError(f"{self.where}: tensor {name!r} is {t.dtype}, expected float8_e4m3fn "
                                 f"(quantization_config: {self.scheme.method})")
            dest.copy_(t)
        else:
            q, scale = quantize(load(None).to(dest.device), self.scheme)
            dest.copy_(take(q, part))
            self._store_scale(name, scale)
        return True

    def _full_weight_shape(self, wname: str) -> tuple[int, int]:
        pname, _, rows = self.expected[wname]
        part = shard_slice(wname, self.shard)
        shape = full_shape((rows, self.params[pname].shape[1]), part)
        return shape[0], shape[1]

    def _store_scale(self, wname: str, scale: torch.Tensor) -> None:
        """Write a weight's whole internal scale (its checkpoint tensor's rows) into its layer's
        scale parameter: this rank's slice, at the weight's row offset in a merged layer."""
        pname, offset, rows = self.expected[wname]
        dest = self.params[pname.removesuffix(".weight") + "." + SCALE_PARAM].data
        part = shard_slice(wname, self.shard)
        block = self.scheme.block
        scale = scale.to(dest.device)
        if block is None:
            if part is not None and part.dim == 0:
                scale = take(scale, part)
            (dest if offset is None else dest.narrow(0, offset, rows)).copy_(scale)
            return
        if part is not None:
            scale = scale.narrow(part.dim, *self._block_span(wname, part, block[part.dim]))
        if offset is None:
            dest.copy_(scale)
            return
        if offset % block[0]:
            raise ValueError(f"{self.where}: tensor {wname!r} starts at row {offset} of its merged layer, "
                             f"not on a {block[0]}-row scale block")
        dest.narrow(0, offset // block[0], scale.shape[0]).copy_(scale)

    def _block_span(self, wname: str, part: Slice, b: int) -> tuple[int, int]:
        """(first block, blocks) of a tensor-parallel slice, which must fall on block edges."""
        end = part.start + part.length
        if part.start % b or (end % b and end != part.full):
            raise ValueError(f"{self.where}: tensor {wname!r}'s tensor-parallel slice [{part.start}, {end}) "
                             f"does not fall on its {b}-wide scale blocks; use another tensor_parallel_size")
        return part.start // b, -(-part.length // b)
