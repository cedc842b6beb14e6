"""Programmatic dependent launch: when it is on. (Every kernel test runs the kernels with
`pdl_start`; `test_kernels_compile_for_hopper` compiles them with the grid-dependency ops.)"""
from __future__ import annotations

import pytest
import torch

from slipstream.ops.pdl import gdc_wait, pdl_launch, use_pdl


def test_pdl_is_off_off_cuda_and_when_disabled(monkeypatch):
    assert use_pdl(torch.device("cpu")) is False
    assert pdl_launch(torch.device("cpu")) == {"USE_PDL": False, "launch_pdl": False}
    monkeypatch.setenv("SLIPSTREAM_PDL", "0")
    # decided before any CUDA call: safe without a GPU
    assert use_pdl(torch.device("cuda", 0)) is False
    assert pdl_launch(torch.device("cuda", 0)) == {"USE_PDL": False, "launch_pdl": False}


def test_this_triton_has_the_grid_dependency_ops():
    assert gdc_wait is not None  # CI's Triton and the GPU machine's both do (3.4+)


@pytest.mark.gpu
def test_pdl_is_on_for_hopper():
    major = torch.cuda.get_device_capability()[0]
    assert use_pdl(torch.device("cuda")) is (major >= 9)
    assert pdl_launch(torch.device("cuda")) == {"USE_PDL": major >= 9, "launch_pdl": major >= 9}


@pytest.mark.gpu
def test_pdl_changes_no_token(tiny_model, monkeypatch):
    """PDL changes when kernels start, never what they compute: with it off and on the
    engine (bf16, CUDA graphs, async) gives the same tokens. A kernel reading its
    predecessor's output before its grid-dependency wait would show up here."""
    import numpy as np

    from slipstream import LLM, SamplingParams

    folder, _ = tiny_model("qwen3")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, int(n)).tolist() for n in rng.integers(4, 120, 24)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("SLIPSTREAM_PDL", flag)
        assert use_pdl(torch.device("cuda")) is (flag == "1")
        llm = LLM(folder, device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=16)
        outs[flag] = [o.token_ids for o in llm.generate(prompts, params)]
        del llm
        torch.cuda.empty_cache()
    assert outs["0"] == outs["1"]
