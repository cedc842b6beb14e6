"""Programmatic dependent launch: when it is on. (Every kernel test runs the kernels with
`pdl_start`; `test_kernels_compile_for_hopper` compiles them with the grid-dependency ops.)"""
from __future__ import annotations

import pytest
import torch

from slipstream.ops.pdl import gdc_wait, use_pdl


def test_pdl_is_off_off_cuda_and_when_disabled(monkeypatch):
    assert use_pdl(torch.device("cpu")) is False
    monkeypatch.setenv("SLIPSTREAM_PDL", "0")
    # decided before any CUDA call: safe without a GPU
    assert use_pdl(torch.device("cuda", 0)) is False


def test_this_triton_has_the_grid_dependency_ops():
    assert gdc_wait is not None  # CI's Triton and the GPU machine's both do (3.4+)


@pytest.mark.gpu
def test_pdl_is_on_for_hopper():
    major = torch.cuda.get_device_capability()[0]
    assert use_pdl(torch.device("cuda")) is (major >= 9)
