"""The point-mass acceptance's Triton kernel (ops/triton_acceptance.py, under TRITON_INTERPRET=1
on the CPU) against its torch reference (runner/acceptance.py): on random steps (rows whose
drafts match the draws for a while, then not; rows with fewer drafts than k and with none;
drafting rows a subset of the sampling rows or all of them), plain and under the bench's
synthetic acceptance (whole and fractional A), every output row is equal exactly, and the rows
outside the drafting ones are left as they were."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from slipstream.ops.triton_acceptance import emit_point_mass_triton
from slipstream.runner.acceptance import emit_point_mass

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _step(seed: int, k: int, every_row: bool):
    rng = np.random.default_rng(seed)
    S = int(rng.integers(1, 7))
    rows = np.arange(S) if every_row else np.sort(rng.choice(S, int(rng.integers(1, S + 1)), replace=False))
    R = len(rows)
    drawn = rng.integers(0, 9, (R, k + 1))
    drafts = drawn[:, :k].copy()
    for r in range(R):  # a wrong draft at a random position (or none)
        at = int(rng.integers(0, k + 1))
        if at < k:
            drafts[r, at] = (drafts[r, at] + 1) % 9
    num_drafts = rng.integers(0, k + 1, R)
    # the static verify inputs' layout: drafts then their count in one int32 [*, k + 2] row
    static = np.zeros((R, k + 2), np.int32)
    static[:, :k], static[:, k] = drafts, num_drafts
    static = torch.tensor(static, device=DEVICE)

    def i32(a):
        return torch.tensor(np.asarray(a), dtype=torch.int32, device=DEVICE)

    outputs = (torch.full((S + 2, k + 1), 77, dtype=torch.int32, device=DEVICE), i32(np.full(S + 2, 55)),
               i32(np.full(S + 2, 66)), i32(np.full(S + 2, 88)))
    seed_col = torch.tensor(rng.integers(0, 2**62, S + 2), dtype=torch.int64, device=DEVICE)
    index_col = i32(rng.integers(0, 3000, S + 2))
    return (i32(drawn), static[:, :k], static[:, k], torch.tensor(rows, dtype=torch.int64, device=DEVICE),
            seed_col, index_col), outputs


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3, 4, 7])
@pytest.mark.parametrize("synthetic", [None, 0, 2, 2.5, 1.25])
def test_the_kernel_equals_the_torch_reference(k, synthetic):
    """Forty random steps a case; the outputs of every row equal, the untouched ones too."""
    from slipstream.runner.acceptance import synthetic_threshold
    picks = 0
    for seed in range(40):
        inputs, want = _step(seed, k, every_row=seed % 2 == 0)
        got = tuple(t.clone() for t in want)
        emit_point_mass(*inputs, synthetic, *want, use_triton=False)
        emit_point_mass_triton(*inputs, None if synthetic is None else (int(synthetic), synthetic_threshold(synthetic)),
                               *got)
        for g, w in zip(got, want):
            assert torch.equal(g.cpu(), w.cpu()), (seed, synthetic)
        rows = inputs[3]
        picks += int((want[1][rows] - 1 > min(int(synthetic or 0), k)).sum()) if synthetic else 0
    if synthetic in (2.5, 1.25) and k > 2:
        assert picks > 0  # the fraction's extra draft happened (not vacuous)


def test_the_reference_accepts_the_matching_prefix():
    """The rule itself, on a hand-made step: drafts equal to the draws before the first
    mismatch are accepted, then the draw at the mismatch; a row's count caps its drafts."""
    drawn = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]], dtype=torch.int32)
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [5, 6, 7], [9, 2, 3]], dtype=torch.int32)
    num_drafts = torch.tensor([3, 3, 1, 3], dtype=torch.int32)
    tokens = torch.zeros(4, 4, dtype=torch.int32)
    num, drafted, last = (torch.zeros(4, dtype=torch.int32) for _ in range(3))
    rows = torch.arange(4)
    emit_point_mass(drawn, drafts, num_drafts, rows, torch.zeros(4, dtype=torch.int64),
                    torch.zeros(4, dtype=torch.int32), None, tokens, num, drafted, last, use_triton=False)
    assert tokens.tolist() == [[5, 6, 7, 8], [5, 6, -1, -1], [5, 6, -1, -1], [1, -1, -1, -1]]
    assert num.tolist() == [4, 2, 2, 1] and drafted.tolist() == [3, 3, 1, 3] and last.tolist() == [8, 6, 6, 1]


@pytest.mark.slow  # two engines under the interpreter: ~5 s
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run on the CPU; a GPU's engine takes "
                    "the kernel itself (tests/test_gpu_spec.py)")
def test_an_ngram_engine_on_the_kernel_equals_plain_decoding(tiny_model, monkeypatch):
    """The engine's verification through the kernel (the interpreter's): the greedy tokens of
    decoding without speculation, drafts accepted, the kernel run every verification step."""
    from slipstream import LLM, SamplingParams
    from slipstream.runner import speculative

    calls = []

    def on_kernel(*a, **kw):
        calls.append(a[0].shape[0])
        return emit_point_mass(*a, **kw, use_triton=True)

    monkeypatch.setattr(speculative, "emit_point_mass", on_kernel)
    folder, _ = tiny_model("llama")
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    prompts = [[5, 6, 7, 8, 9, 10] * 4, [40, 41, 42] * 7 + [40], [3, 1, 4, 1, 5, 9, 2, 6] * 3]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(folder, device="cpu", max_model_len=256).generate(prompts, params)]
    for async_scheduling in (False, True):
        llm = LLM(folder, device="cpu", max_model_len=256, speculative_config=ngram, async_scheduling=async_scheduling)
        calls.clear()
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
        assert len(calls) >= 5, calls
        assert llm.engine.stats()["spec_num_accepted_tokens"] > 0


def compile_for_hopper() -> None:
    """The kernel as `emit_point_mass_triton` launches it (fractional synthetic: every branch),
    compiled for sm_90."""
    from helpers import compile_pdl_launches_for_hopper
    from test_attention_kernels import recorded_launches

    import slipstream.ops.triton_acceptance as m
    launches: list = []
    inputs, outputs = _step(3, 4, every_row=True)
    with recorded_launches(m, ["_point_mass_kernel"], launches):
        m.emit_point_mass_triton(*inputs, (2, 1 << 23), *outputs)
    assert len(launches) == 1
    compile_pdl_launches_for_hopper(launches)


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel runs compiled")
def test_the_kernel_compiles_for_hopper():
    from helpers import run_hopper_compile
    out = run_hopper_compile(__file__)
    assert [ln for ln in out.splitlines() if ln.startswith("compiled")] == ["compiled _point_mass_kernel"], out


if __name__ == "__main__":
    import sys
    if "--compile-for-hopper" in sys.argv:
        compile_for_hopper()
