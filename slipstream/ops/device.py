"""Facts about the device that kernel launch heuristics need (cached per device)."""
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
