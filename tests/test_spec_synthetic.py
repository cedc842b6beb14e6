"""`slipstream bench --spec-synthetic-accept A`: a benchmark knob under which every
verification step accepts min(A, drafted) drafts whatever the model says and every row
drafts (n-gram misses repeat the last token), so a run emits A + 1 tokens a drafting row-step
with random weights; the run is labelled in the printout and the JSON; the knob is not an
engine option (LLM and serve cannot reach it)."""
import json

import pytest

from slipstream import SamplingParams
from slipstream.config import EngineConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}


def _bench(tiny_model, tmp_path, monkeypatch, accept: int, mode: str = "both"):
    from slipstream.bench import workloads
    from slipstream.cli.main import main

    folder, _ = tiny_model("llama")
    prompts = [[7 * i + j + 3 for j in range(6)] for i in range(4)]  # no repeated n-gram
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True) for _ in prompts]
    monkeypatch.setitem(workloads.WORKLOADS, "synthetic-unit", lambda: workloads.Workload(
        "synthetic-unit", folder, prompts, params, dict(max_num_seqs=4, max_model_len=128)))
    out = tmp_path / f"a{accept}"
    assert main(["bench", "--workload", "synthetic-unit", "--device", "cpu", "--mode", mode,
                 "--speculative-config", json.dumps(NGRAM), "--spec-synthetic-accept", str(accept),
                 "--out", str(out)]) == 0
    return json.loads((out / "synthetic-unit.json").read_text())


@pytest.mark.slow  # a bench run of two engines a case; the quick tier keeps test_accepting_more_than_one
@pytest.mark.parametrize("accept", [0, 1])
def test_every_drafting_row_step_emits_accept_plus_one(tiny_model, tmp_path, monkeypatch, capsys, accept):
    summary = _bench(tiny_model, tmp_path, monkeypatch, accept)
    assert summary["synthetic_acceptance"] == accept
    for mode in ("sync", "async"):
        s = summary["results"][mode]["speculation"]
        assert s["synthetic_acceptance"] == accept
        assert s["drafted"] > 0 and s["steps_with_drafts"] > 0  # random prompts: drafts all the same
        assert s["mean_accepted_length"] == accept + 1
    out = capsys.readouterr().out
    assert "SYNTHETIC ACCEPTANCE" in out and "speculation (SYNTHETIC ACCEPTANCE" in out


@pytest.mark.slow
def test_accepting_more_than_one(tiny_model, tmp_path, monkeypatch):
    """A = 2 of k = 3: 3 tokens a drafting row-step, except near max_tokens (fewer drafts)."""
    summary = _bench(tiny_model, tmp_path, monkeypatch, 2, mode="async")
    s = summary["results"]["async"]["speculation"]
    assert 2.6 < s["mean_accepted_length"] <= 3.0, s


@pytest.mark.slow
def test_a_fractional_acceptance_mixes_its_two_neighbours(tiny_model, tmp_path, monkeypatch):
    """A = 1.5 of k = 3: 2 or 3 tokens a drafting row-step, about half each (the bench's
    3.5-tokens-a-step EAGLE-3 arm is A = 2.5)."""
    summary = _bench(tiny_model, tmp_path, monkeypatch, 1.5, mode="async")
    assert summary["synthetic_acceptance"] == 1.5
    s = summary["results"]["async"]["speculation"]
    assert 2.2 < s["mean_accepted_length"] < 2.8, s


def test_the_knob_is_not_an_engine_option(tiny_model):
    assert not any("synthetic" in name for name in EngineConfig.__dataclass_fields__)
    from slipstream.core.engine_core import EngineCore
    folder, _ = tiny_model("llama")
    engine = EngineCore(EngineConfig(model=folder, device="cpu", max_model_len=64, max_num_seqs=2))
    with pytest.raises(ValueError, match="needs --speculative-config"):
        engine.set_bench_synthetic_acceptance(1)
    engine = EngineCore(EngineConfig(model=folder, device="cpu", max_model_len=64, max_num_seqs=2,
                                     speculative_config=NGRAM))
    with pytest.raises(ValueError, match=r"must be in \[0, num_speculative_tokens=3\]"):
        engine.set_bench_synthetic_acceptance(4)


@pytest.mark.parametrize("a", [2.5, 1.25])
def test_a_fractional_acceptance_holds_its_mean_over_a_long_row(a):
    """The picks hold A's fraction whatever lengths the steps take: a row's next position moves
    by the tokens it emitted, which the picks themselves decide (a Weyl sequence in the
    position drifted to 2.23 at A = 2.5, steps of 3 and 4 sampling it unevenly).  64 rows of
    different seeds, 300 steps each."""
    import torch

    from slipstream.runner.acceptance import synthetic_accepted
    k, rows, steps = 4, 64, 300
    seed = torch.arange(rows, dtype=torch.int64) * 7919 + 17
    pos = torch.zeros(rows, dtype=torch.int64)
    total = torch.zeros(rows, dtype=torch.int64)
    num_drafts = torch.full((rows,), k, dtype=torch.int32)
    for _ in range(steps):
        accepted = synthetic_accepted(num_drafts, seed, pos, a)
        pos += accepted + 1
        total += accepted
    assert abs(total.sum().item() / (rows * steps) - a) < 0.02
    assert (total.double() / steps - a).abs().max().item() < 0.15  # every row, not just the mean
