"""Facts about the device that kernel launches need: the SM count (cached per device), and
how `tl.dot` must run for a dtype on it."""
from __future__ import annotations

import torch

NOMINAL_SM_COUNT = 132  # an H200's: what launch heuristics assume without a GPU (interpreter runs)

_SM_COUNTS: dict[int, int] = {}


def sm_count(device: torch.device, cpu: int = NOMINAL_SM_COUNT) -> int:
    """Streaming multiprocessors of a CUDA device; `cpu` for any other device."""
    if device.type != "cuda":
        return cpu
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNTS:
        _SM_COUNTS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNTS[idx]


def dot_flags(dtype: torch.dtype, device: torch.device) -> tuple[bool, bool]:
    """(IEEE, UPCAST) for the kernels' dots: float32 inputs take IEEE products (not TF32);
    bf16 is upcast under the CPU interpreter, which would multiply the raw bits."""
    return dtype == torch.float32, device.type != "cuda" and dtype == torch.bfloat16
