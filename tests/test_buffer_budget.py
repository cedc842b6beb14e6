"""Engine flags are bounded by the memory the device has free, before the runner allocates
its buffers (issue 48): --max-num-seqs 10000000 or --max-num-batched-tokens 1e9 is a one-line
error naming the flags, not a 20 GB allocation."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from slipstream.runner.buffer_budget import GiB, buffer_bytes, check_buffer_budget, free_bytes

SMOLLM2 = SimpleNamespace(vocab_size=49152, hidden_size=576, intermediate_size=1536)


def test_the_defaults_need_little_and_the_estimate_grows_with_the_flags():
    small = buffer_bytes(256, 8192, 8192, 16, 49152, 576, 1536)
    assert small < 0.5 * GiB
    assert buffer_bytes(512, 8192, 8192, 16, 49152, 576, 1536) > small
    assert buffer_bytes(256, 16384, 8192, 16, 49152, 576, 1536) > small
    assert free_bytes(torch.device("cpu")) > 0


@pytest.mark.parametrize("seqs, tokens, model_len", [(10_000_000, 10_000_000, 8192), (256, 10 ** 9, 8192),
                                                     (256, 8192, 10 ** 12)])
def test_buffers_past_the_free_memory_are_a_one_line_error_naming_the_flags(seqs, tokens, model_len):
    with pytest.raises(ValueError) as e:
        check_buffer_budget(seqs, tokens, model_len, 16, SMOLLM2, torch.device("cpu"), free=64 * GiB)
    message = str(e.value)
    assert f"max_num_seqs={seqs}, max_num_batched_tokens={tokens}" in message and "64.0 GiB free" in message
    assert "--max-num-seqs" in message and "\n" not in message
    check_buffer_budget(256, 8192, 8192, 16, SMOLLM2, torch.device("cpu"), free=64 * GiB)


def test_the_engine_refuses_them_before_allocating(tiny_model):
    from slipstream import LLM
    folder, _ = tiny_model("llama")
    with pytest.raises(ValueError, match="max_num_batched_tokens=1000000000 and max_model_len"):
        LLM(folder, load_format="dummy", device="cpu", max_num_batched_tokens=10 ** 9)
