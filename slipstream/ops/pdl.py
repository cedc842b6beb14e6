"""Programmatic dependent launch (PDL, Hopper and later): a kernel may be launched while the
kernel before it on the stream is still running, and waits for it (`gdc_wait`) before it
touches memory. What it saves is the launch gap between two kernels (~1 µs inside a CUDA
graph; benchmarks/notes/kernel-notes.md, "Programmatic dependent launch"), which a 0.6B decode step
pays ~260 times (only between two PDL kernels: cuBLAS's GEMMs are launched normally).

The rule every PDL kernel here follows: `pdl_start(USE_PDL)` is its first statement, in
every program, before any load or store and before any early return. So a kernel finishes
only after the one before it has finished and flushed its writes, and an output is visible
to every later kernel as without PDL; and since a kernel lets the next one launch only
after its own wait, a kernel that starts early finds every kernel before the previous one
finished. The exceptions are loads of memory no kernel of the step writes, which may come
first so that they stream while the previous kernel ends: the weights (`triton_gemv.py`),
and with `DecodeConfig.prefetch_batch` the decode kernel's row metadata (uploaded before
the step) and first KV tile except each row's newest position (written by earlier steps;
`triton_attention_kernels.py`), and the qkv epilogue's positions, cos/sin rows and cache
slots (`triton_qkv_epilogue.py`). One kernel also reads before its wait what kernels two or
more back wrote, which a kernel that starts early finds finished: the small MoE down
kernel's expert ids, routing weights and residual row (the router's and the o projection's;
`triton_moe_small.py`), with its first weight tile. Kernels that are not Triton's (cuBLAS,
torch) are launched normally: they wait for the complete previous kernel.

`use_pdl(device)`: on for CUDA devices of compute capability 9.0+ when this Triton has the
grid-dependency ops; `SLIPSTREAM_PDL=0` in the environment turns it off (A/B runs).
`pdl_launch(device)`: the two launch arguments that must agree, the kernel's `USE_PDL` (it
waits) and Triton's `launch_pdl` (it may start early); a kernel launched early that did not
wait would read its inputs before they are written.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:  # Hopper's grid dependency control (Triton 3.4+)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - old Triton: PDL stays off
    gdc_launch_dependents = gdc_wait = None

_ENABLED: dict[int, bool] = {}


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with PDL."""
    if device.type != "cuda" or gdc_wait is None or os.environ.get("SLIPSTREAM_PDL", "1") == "0":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _ENABLED:
        _ENABLED[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _ENABLED[idx]


def pdl_launch(device: torch.device) -> dict:
    """Launch arguments of a kernel that calls `pdl_start(USE_PDL)`: `**pdl_launch(device)`."""
    on = use_pdl(device)
    return {"USE_PDL": on, "launch_pdl": on}


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    """Wait for the previous kernel, then let the next one launch (it waits for us in turn)."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
