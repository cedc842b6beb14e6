"""Per-device int32 tickets for kernels whose programs combine partial sums: a program counts
itself in with an atomic add, the last one of its tile to arrive finishes the tile and puts
the ticket back to zero, so every launch leaves them all at zero for the next one (no memset
kernel before a launch, nothing to re-zero inside a CUDA graph). Kernels on one device share
them: they run one after another on the compute stream, and with PDL a launch touches its
tickets only after its wait, when the previous kernel has finished. Users: the FP8 GEMV's
split-K (ops/triton_fp8_gemv_mma.py) and the skinny FP8 GEMM's (ops/triton_fp8_gemm_skinny.py).
"""
from __future__ import annotations

import torch

_TICKETS: dict[torch.device, torch.Tensor] = {}


def device_key(device: torch.device) -> torch.device:
    """`cuda` and `cuda:<current>` are one device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def refuse_in_capture(device: torch.device, what: str, reserve: str) -> None:
    """A device buffer that would first be allocated inside a CUDA graph capture (its zeros or
    contents not written until the first replay) is an error naming what reserves it."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what} would first be allocated inside a CUDA graph capture ({reserve} at model "
                           "load reserves it)")


def reserve_tickets(device: torch.device, count: int) -> None:
    """Allocate (zeroed, eagerly) at least `count` tickets: the model calls it at load, so that
    none is first allocated inside a CUDA graph capture, where its zeros would not be written
    until the graph's first replay."""
    tickets(device, count)


def tickets(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` zeroed tickets on `device` (grown outside a graph capture only)."""
    key = device_key(device)
    have = _TICKETS.get(key)
    if have is not None and have.numel() >= count:
        return have
    refuse_in_capture(key, f"{count} tickets", "reserve_tickets")
    grown = torch.zeros(max(count, have.numel() if have is not None else 0), dtype=torch.int32, device=key)
    _TICKETS[key] = grown
    return grown
