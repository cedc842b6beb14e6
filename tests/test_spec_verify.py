"""The verification step on the decode-kernel route (runner/verify_graphs.py): which batches
take it, and the padded layout a CUDA graph runs, run eagerly on the CPU (a step-graph object
with no pool pads the batches as the GPU's graphs do and captures nothing), token-identical
to decoding without speculation, sync and async.  The GPU half: tests/test_gpu_spec_verify.py."""
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from slipstream import LLM, SamplingParams
from slipstream.runner.graphs import StepGraphs, capture_sizes
from slipstream.runner.verify_graphs import verify_route

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [[5, 6, 7, 8, 9, 10] * 5, [40, 41, 42] * 7 + [40], [3, 1, 4, 1, 5, 9, 2, 6] * 3, [100, 101, 102, 103]]


def _llm(folder, padded: bool, **kw) -> LLM:
    llm = LLM(folder, device="cpu", max_model_len=256, max_num_seqs=8, **kw)
    if padded:  # the GPU's padding (decode batches to 1, 2, 4, 8 rows), nothing captured
        runner = llm.engine.runner
        runner.graphs = StepGraphs(capture_sizes(8), [], 8, runner.max_model_len)
    return llm


def _tokens(llm, params):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def _route_runner(graphs=None):
    host = SimpleNamespace(input_ids=np.zeros(64, np.int32))
    return SimpleNamespace(graphs=graphs, slots=[SimpleNamespace(host=host)])


def _batch(num_new, sampled=None, k=3):
    n = np.array(num_new)
    sampled = list(range(len(n))) if sampled is None else sampled
    return SimpleNamespace(spec=SimpleNamespace(k=k), num_new=n, num_seqs=len(n), sampled=sampled,
                           sample_seq=np.array(sampled))


def test_which_batches_take_the_verify_route():
    runner = _route_runner()
    route = verify_route(runner, _batch([4, 1, 2]))
    assert route is not None and route.q_len == 4 and route.pad is None  # no graphs: unpadded
    assert verify_route(runner, _batch([5, 1])) is None  # a prompt chunk (more than k + 1 tokens)
    assert verify_route(runner, _batch([4, 3], sampled=[1])) is None  # a row that does not sample
    assert verify_route(runner, _batch([1, 1])) is None  # nothing to verify: a decode step
    graphs = StepGraphs(capture_sizes(8), [], 8, 256)
    route = verify_route(_route_runner(graphs), _batch([4, 1, 2]))
    assert route.pad.num_seqs == 4 and route.pad.num_tokens == 16  # rows to a graph size, k + 1 each
    big = _route_runner(graphs)
    big.slots[0].host.input_ids = np.zeros(8, np.int32)  # the padded tokens must fit the slot
    assert verify_route(big, _batch([4, 1, 2])).pad is None


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_padded_verify_steps_equal_plain_decoding(tiny_model, async_scheduling):
    """Greedy and seeded sampled rows (top-k: the sampler's other variant) through the padded
    verify step: the tokens of decoding without speculation, drafts accepted."""
    folder, _ = tiny_model("llama")
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=1.0, top_k=5, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)]
    plain = _tokens(_llm(folder, False, async_scheduling=async_scheduling), params)
    llm = _llm(folder, True, async_scheduling=async_scheduling, speculative_config=NGRAM)
    calls = []
    import slipstream.runner.speculative as sp
    orig = sp.verify_step
    sp.verify_step = lambda *a, **kw: (calls.append(a[2].num_seqs), orig(*a, **kw))[1]
    try:
        spec = _tokens(llm, params)
    finally:
        sp.verify_step = orig
    assert spec == plain
    assert calls and all(p in (1, 2, 4, 8) for p in calls), calls  # the padded route ran
    stats = llm.engine.stats()
    assert stats["spec_num_accepted_tokens"] > 0, stats
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_padded_route_leaves_penalties_and_logprobs_to_the_eager_layout(tiny_model):
    """Rows with penalties or logprobs: the padded shape, the eager verification (no graph
    can hold them), the plain tokens and logprobs."""
    folder, _ = tiny_model("llama")
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)]
    plain = _llm(folder, False).generate(PROMPTS, params)
    spec = _llm(folder, True, speculative_config=NGRAM).generate(PROMPTS, params)
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    got = [{t: round(v, 4) for t, v in e.items()} for e in spec[1].outputs[0].logprobs]
    want = [{t: round(v, 4) for t, v in e.items()} for e in plain[1].outputs[0].logprobs]
    assert got == want


def test_bench_verify_step_runs_end_to_end_on_the_cpu(tmp_path, capsys):
    import json

    import bench_verify_step
    assert bench_verify_step.main(["--device", "cpu", "--tiny", "--rows", "1", "2", "--ks", "1", "3",
                                   "--context", "40", "--iters", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| rows | plain ms | k=1 | k=3 |" in out and "1 row, k <= 4: worst" in out
    res = json.load(open(tmp_path / "bench_verify_step.json"))
    rows = res["results"]["tiny"]
    assert [(r["rows"], r["k"]) for r in rows] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert all(r["verify_ms"] > 0 and r["plain_ms"] > 0 and r["verify_forward_ms"] > 0 for r in rows)
    assert "| rows | plain forward ms | k=1 | k=3 |" in out
    assert res["blas"] == "default" and "BLAS default" in out


def test_bench_verify_step_refuses_a_blas_library_without_cuda(capsys):
    import bench_verify_step
    with pytest.raises(SystemExit):
        bench_verify_step.main(["--device", "cpu", "--tiny", "--blas", "cublaslt"])
    assert "--blas cublaslt needs --device cuda" in capsys.readouterr().err


def test_bench_fewrow_splitk_splits_the_product_and_reports(tmp_path, capsys):
    """benchmarks/bench_fewrow_splitk.py on the CPU (tiny shapes): the K-split product equals
    the plain one and every product gets a row per row count."""
    import json

    import torch

    import bench_fewrow_splitk as probe
    x, w = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(48, 64, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), w.float())
    for S in (1, 2, 4):
        assert torch.allclose(probe.split_product(x, w, S).float(), want, atol=0.1, rtol=0.02)
    assert probe.main(["--device", "cpu", "--rows", "1", "4", "--splits", "2", "--out", str(tmp_path)]) == 0
    res = json.load(open(tmp_path / "bench_fewrow_splitk.json"))
    assert [(r["product"], r["rows"]) for r in res["rows"]] == [(n, m) for n, _, _ in probe.SHAPES for m in (1, 4)]
    assert all(r["cublas_us"] > 0 and r["split2_x"] > 0 for r in res["rows"])
    assert "o_proj" in capsys.readouterr().out


def test_bench_fewrow_addmm_times_each_form_and_reports(tmp_path, capsys):
    """benchmarks/bench_fewrow_addmm.py on the CPU (tiny shapes): every product gets a row per
    row count with each form's time and its ratio to addmm (the forms' results are checked
    against a float reference inside)."""
    import json

    import bench_fewrow_addmm as probe
    assert probe.main(["--device", "cpu", "--rows", "1", "4", "--out", str(tmp_path)]) == 0
    res = json.load(open(tmp_path / "bench_fewrow_addmm.json"))
    assert [(r["product"], r["rows"]) for r in res["rows"]] == [(n, m) for n, _, _ in probe.SHAPES for m in (1, 4)]
    assert all(r[f"{f}_us"] > 0 for r in res["rows"] for f in ("addmm", "mm_add", "mm"))
    assert "o_proj" in capsys.readouterr().out


def _verify_rows_tensors(R: int, k: int, temperature: float, top_k: int, first_index: int):
    """The sampling tensors of R verifying rows' k + 1 positions each: row r's seed r, output
    indices first_index.. along the row, no penalties or other cuts."""
    import torch

    from slipstream.sampling.sampler import SamplingTensors
    n = R * (k + 1)
    temp = torch.full((n,), temperature)
    return SamplingTensors(temperature=temp, top_k=torch.full((n,), top_k, dtype=torch.int32), top_p=torch.ones(n),
                           min_p=torch.zeros(n), seed=torch.arange(n, dtype=torch.int64) // (k + 1),
                           token_index=(torch.arange(n) % (k + 1) + first_index).to(torch.int32),
                           repetition_penalty=torch.ones(n), presence_penalty=torch.zeros(n),
                           frequency_penalty=torch.zeros(n), state_row=torch.zeros(n, dtype=torch.int32),
                           inv_t=1.0 / torch.where(temp > 0, temp, torch.ones(n)),
                           log_min_p=torch.full((n,), float("-inf")))


@pytest.mark.parametrize("greedy", [True, False])
def test_point_mass_acceptance_from_the_samplers_draws_equals_rejection_sampling(greedy):
    """verify's point-mass path (the plain sampler's draws at every position, then
    `accept_draws`) emits what spec.rejection.rejection_sample emits from the processed
    distribution, row for row, with drafts matching the draws for a while then not."""
    import torch

    from slipstream.runner.acceptance import accept_draws
    from slipstream.sampling.sampler import SamplerFlags, processed_logits, sample
    from slipstream.spec.rejection import rejection_sample
    R, k, V = 6, 4, 50
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(R * (k + 1), V, generator=g) * 3
    t = _verify_rows_tensors(R, k, 0.0 if greedy else 0.9, 0 if greedy else 10, first_index=7)
    temp = t.temperature
    flags = SamplerFlags(use_top_k_top_p=not greedy, use_penalties=False, num_logprobs=0)
    drawn = sample(logits, t, flags).tokens.view(R, k + 1)
    drafts = drawn[:, :k].clone().to(torch.int32)
    for r in range(R):  # row r matches its first r draws (then a wrong draft)
        if r < k:
            drafts[r, r] = (drafts[r, r] + 1) % V
    num_drafts = torch.tensor([4, 4, 3, 2, 4, 0], dtype=torch.int32)
    out, num = accept_draws(drawn, drafts, num_drafts)
    want_out, want_num = rejection_sample(processed_logits(logits, t, flags).view(R, k + 1, V), drafts, num_drafts,
                                          None, temp.view(R, k + 1)[:, 0] == 0, seed=t.seed.view(R, k + 1)[:, 0],
                                          token_index=t.token_index.view(R, k + 1)[:, 0])
    assert torch.equal(out, want_out) and torch.equal(num.to(torch.int32), want_num)
    assert num.tolist() == [1, 2, 3, 3, 5, 1]


@pytest.mark.parametrize("greedy", [True, False])
def test_synthetic_acceptance_from_the_draws_equals_it_from_the_target(greedy):
    """The bench's synthetic outcome on the point-mass path (from the sampler's draws at every
    position) emits what it emits from the processed target distribution: the same accepted
    drafts, then the same draw at the next position."""
    import torch

    from slipstream.runner.acceptance import synthetic_from_draws, synthetic_from_target
    from slipstream.sampling.sampler import SamplerFlags, processed_logits, sample
    R, k, V = 6, 4, 50
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(R * (k + 1), V, generator=g) * 3
    t = _verify_rows_tensors(R, k, 0.0 if greedy else 0.9, 0, first_index=11)
    temp = t.temperature
    flags = SamplerFlags(use_top_k_top_p=False, use_penalties=False, num_logprobs=0)
    drawn = sample(logits, t, flags).tokens.view(R, k + 1)
    drafts = torch.randint(0, V, (R, k), generator=g, dtype=torch.int32)
    num_drafts = torch.tensor([4, 4, 3, 2, 4, 0], dtype=torch.int32)
    seed, index = t.seed.view(R, k + 1)[:, 0], t.token_index.view(R, k + 1)[:, 0]
    for a in (0, 1, 2.5, 4):
        out, num = synthetic_from_draws(drawn, drafts, num_drafts, seed, index, a)
        want_out, want_num = synthetic_from_target(processed_logits(logits, t, flags).view(R, k + 1, V), drafts,
                                                   num_drafts, temp.view(R, k + 1)[:, 0] == 0, seed, index, a)
        assert torch.equal(out, want_out) and torch.equal(num, want_num), a
        assert num.tolist()[-1] == 1 and num.max().item() <= min(a, 4) + 1.5
