"""FP8 e4m3 arithmetic in plain torch: quantize weights per tensor, per output channel or in
blocks, dequantize them, and quantize activations per token (or per token and K-group).

The conventions every format of this package converts to:

- a quantized weight is `q` float8_e4m3fn [N, K] and a float32 `scale` that *multiplies*:
  w ~= q * scale. Per tensor and per channel the scale is [N] (a per-tensor scale is one value
  repeated over its rows: merged q/k/v rows keep each part's own value); blocks have
  [ceil(N / bn), ceil(K / bk)], one value a (bn x bk) block.
- a scale is amax / 448 (e4m3's largest finite value), floored at `MIN_SCALE` so that an
  all-zero row or block divides by something.
- e4m3 keeps 3 mantissa bits: a value is rounded to within 2^-4 of itself (half of one step,
  2^-3 relative, of its binade); values below 2^-6 * scale are subnormal and lose more.

These functions are the references the Triton kernels are tested against, and the CPU path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12
# half of one step at 3 mantissa bits: |round(x) - x| <= REL_ERR * |x| for normal values
REL_ERR = 2.0 ** -4


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def amax_scale(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 rounded once (IEEE division), at least MIN_SCALE. The divisor is a tensor on
    amax's device: torch on CUDA divides by a Python scalar as a product with its rounded
    reciprocal, one ulp off the quotient for some amax, which the Triton quantizers (div_rn)
    and the CPU would not reproduce."""
    return (amax / torch.full((), FP8_MAX, dtype=amax.dtype, device=amax.device)).clamp(min=MIN_SCALE)


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K], scale [N]): one scale for the whole tensor, repeated over its rows."""
    wf = w.float()
    scale = amax_scale(wf.abs().amax())
    return _to_fp8(wf / scale), scale.expand(w.shape[0]).contiguous()


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K], scale [N]): one scale an output row (`--quantization fp8` at load)."""
    wf = w.float()
    scale = amax_scale(wf.abs().amax(dim=1))
    return _to_fp8(wf / scale[:, None]), scale


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K], scale [ceil(N / bn), ceil(K / bk)]): one scale a (bn x bk) block; edge
    blocks cover what is left of the rows / columns."""
    bn, bk = block
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros((nb * bn, kb * bk), dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    tiles = padded.view(nb, bn, kb, bk)
    scale = amax_scale(tiles.abs().amax(dim=(1, 3)))
    q = _to_fp8(tiles / scale[:, None, :, None]).view(nb * bn, kb * bk)[:n, :k]
    return q.contiguous(), scale


def expand_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int] | None) -> torch.Tensor:
    """float32 [N, K]: each weight's scale."""
    n, k = shape
    if block is None:
        return scale.float()[:, None].expand(n, k)
    bn, bk = block
    return scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale as `dtype` [N, K] (float32 products, one rounding to `dtype`)."""
    return (q.float() * expand_scale(scale, tuple(q.shape), block)).to(dtype)


def quantize_per_token(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: (q [M, K], scale [M, G]) with one scale a row (G = 1)
    or a row's `group`-wide slice of K (G = ceil(K / group)), as the block-scaled GEMM reads
    them."""
    xf = x.float()
    m, k = xf.shape
    g = group or k
    ng = -(-k // g)
    padded = torch.zeros((m, ng * g), dtype=torch.float32, device=x.device)
    padded[:, :k] = xf
    parts = padded.view(m, ng, g)
    scale = amax_scale(parts.abs().amax(dim=2))
    q = _to_fp8(parts / scale[:, :, None]).view(m, ng * g)[:, :k]
    return q.contiguous(), scale


@dataclass
class Fp8Weight:
    """A linear layer's FP8 weight, what the FP8 linear ops take (ops/fp8_linear.py).

    qweight: float8_e4m3fn [N, K]; scale: float32 [N], or [N / bn, K / bk] with `block`;
    gamma: float32 [K] or None, an RMSNorm weight folded into the layer (model/llama.py,
    "Folded norms"): the input's columns are scaled by it before the product, since multiplying
    it into the FP8 columns would round every weight a second time."""
    qweight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None = None
    gamma: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as `dtype` [N, K] (gamma not applied)."""
        return dequantize(self.qweight, self.scale, self.block, dtype)

    def nbytes(self) -> int:
        """Bytes a product reads of this weight: the FP8 values and the scales."""
        extra = self.gamma.numel() * 4 if self.gamma is not None else 0
        return self.qweight.numel() + self.scale.numel() * 4 + extra
