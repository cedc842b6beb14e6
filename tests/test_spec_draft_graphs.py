"""The device drafters' padded step (runner/draft_graphs.py): a decode-only batch of an EAGLE-3
or draft-model engine runs the verification, the drafter's extend and its k drafts as one
function of static inputs, padded to a decode graph's rows (one CUDA graph replay a step on a
GPU; on the CPU the same function, eager).  Tested: greedy output equals the eager path
(enforce_eager) and plain decoding, sync and async, with padding rows in the batch; seeded
sampling equals the eager path; the padded inputs mark padding rows and tokens so that they
write nowhere a request reads.  On a GPU (`gpu`): the steps replay graphs and equal eager and
plain decoding, greedy; seeded sampling sync equals async; the 8B shape replays its graph."""
import numpy as np
import pytest

from slipstream import LLM, SamplingParams
from test_spec_eagle3_engine import _eagle, _prompts, _tokens, random_head  # noqa: F401 (fixtures)


def _draft(folder, k=3):
    return {"method": "draft_model", "model": folder, "num_speculative_tokens": k}


def _spec(method, folder, head):
    return _eagle(head) if method == "eagle3" else _draft(folder)


def _llm(folder, device="cpu", **kw):
    kw.setdefault("max_model_len", 128)
    extra = {"dtype": "float32"} if device == "cuda" else {"debug_kv": True}
    return LLM(folder, device=device, max_num_seqs=8, **extra, **kw)


def _padded_steps(llm) -> int:
    g = getattr(llm.engine.runner, "drafting_graphs", None)
    return sum(g.steps) if g is not None else 0


# three prompts: padded to four rows (decode graphs of 1, 2, 4, 8 rows), one padding row
PROMPTS = _prompts()[:3]


GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_model):
    folder, _ = tiny_model("llama")
    return _tokens(_llm(folder).generate(PROMPTS, GREEDY))


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_padded_step_equals_eager_and_plain_greedy(tiny_model, random_head, plain, method,  # noqa: F811
                                                   async_scheduling):
    folder, _ = tiny_model("llama")
    greedy = GREEDY
    spec = _spec(method, folder, random_head)
    eager = _llm(folder, async_scheduling=async_scheduling, enforce_eager=True, speculative_config=spec)
    assert _tokens(eager.generate(PROMPTS, greedy)) == plain
    assert _padded_steps(eager) == 0
    padded = _llm(folder, async_scheduling=async_scheduling, speculative_config=spec)
    assert _tokens(padded.generate(PROMPTS, greedy)) == plain
    assert _padded_steps(padded) >= 3  # (the decode steps; the prefill step stays eager)
    s, e = padded.engine.stats(), eager.engine.stats()
    for key in ("spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_num_emitted_tokens"):
        assert s[key] == e[key] > 0 or key == "spec_num_accepted_tokens" and s[key] == e[key], (key, s, e)


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_padded_step_equals_eager_seeded_sampling(tiny_model, random_head, method):  # noqa: F811
    """The padded step takes the drafter's q from its buffers (what the eager step stacks):
    the same emitted tokens under the same seeds, in both loops."""
    folder, _ = tiny_model("llama")
    params = [SamplingParams(max_tokens=12, temperature=0.9, seed=7 + i, ignore_eos=True) for i in range(3)]
    spec = _spec(method, folder, random_head)
    runs = []
    for enforce_eager, async_scheduling in ((True, False), (False, False), (False, True)):
        llm = _llm(folder, async_scheduling=async_scheduling, enforce_eager=enforce_eager, speculative_config=spec)
        runs.append(_tokens(llm.generate(PROMPTS, params)))
        assert (_padded_steps(llm) > 0) == (not enforce_eager)
    assert runs[0] == runs[1] == runs[2]


def test_padded_inputs_mark_padding_rows_and_tokens(tiny_model, random_head, monkeypatch):  # noqa: F811
    """Every padded step's static inputs: padding rows have no draft slots (-1), the scratch
    row and first token 0; a real row's first token is its last query token less its draft
    slots; tokens past the real ones have row -1; and the drafter's KV of request-table rows
    no request ran in stays zero (padding stores nothing there)."""
    from slipstream.runner import draft_graphs

    seen = []
    upload = draft_graphs.DraftGraphInputs.upload

    def spy(self, batch, host, P, PT, scratch_row):
        upload(self, batch, host, P, PT, scratch_row)
        m, h = self.max_seqs, self.host.numpy()
        seen.append((batch.num_seqs, P, PT, scratch_row, host.logits_indices[:P].copy(), h[:m].copy(),
                     h[m:2 * m].copy(), h[2 * m:3 * m].copy(), h[3 * m:3 * m + PT].copy()))

    monkeypatch.setattr(draft_graphs.DraftGraphInputs, "upload", spy)
    folder, _ = tiny_model("llama")
    llm = _llm(folder, speculative_config=_eagle(random_head))
    llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    k, m = 3, 8
    assert any(B < P for B, P, *_ in seen)
    for B, P, PT, scratch, logits_at, first, slots, rows, token_rows in seen:
        assert PT == P * (k + 1) and scratch == m
        assert np.all(slots[B:P] == -1) and np.all(rows[B:P] == scratch) and np.all(first[B:P] == 0)
        assert np.all(slots[:B] >= 0) and np.all(slots[:B] <= k) and len(set(rows[:B])) == B
        assert np.array_equal(first[:B], logits_at[:B] - slots[:B])
        real = int(np.sum(slots[:B] + 1))
        assert np.array_equal(token_rows[:real], np.repeat(rows[:B], slots[:B] + 1))
        assert np.all(token_rows[real:] == -1)
    drafter = llm.engine.runner.drafter
    kv = drafter.kv_cache[0].view(m + 1, drafter.blocks_per_row, -1)
    used = {int(r) for step in seen for r in step[7][:step[0]]}
    unused = sorted(set(range(m)) - used)
    assert unused and kv[unused].abs().sum() == 0
    assert kv[sorted(used)].abs().sum() > 0


def test_rows_above_cuda_graph_max_batch_run_eagerly(tiny_model, random_head, plain, monkeypatch):  # noqa: F811
    """cuda_graph_max_batch 2: decode-only steps of three rows take the eager step, those of at
    most two the padded one (to at most two rows); the output is plain decoding's."""
    from slipstream.runner import draft_graphs

    routes = []
    route = draft_graphs.drafting_route

    def spy(runner, batch):
        r = route(runner, batch)
        routes.append((batch.num_seqs, int(max(batch.num_new)), None if r is None else r.pad.num_seqs))
        return r

    monkeypatch.setattr(draft_graphs, "drafting_route", spy)
    folder, _ = tiny_model("llama")
    llm = _llm(folder, speculative_config=_eagle(random_head), cuda_graph_max_batch=2)
    lengths = (16, 10, 5)  # (three rows, then two, then one)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in lengths]
    expected = [[(p[0][0][:m], "length")] for p, m in zip(plain, lengths)]
    assert _tokens(llm.generate(PROMPTS, params)) == expected
    decode = [(B, P) for B, n, P in routes if 1 < n <= 4]
    assert any(B == 3 for B, _ in decode) and all(P is None for B, P in decode if B == 3)
    assert any(P is not None for _, P in decode) and all(B <= P <= 2 for B, P in decode if P is not None)


# -- on a CUDA GPU: one graph replay a step --------------------------------------------------

def _all_replayed(llm) -> None:
    """Every padded step but each graph key's first (eager, compiling its kernels) replayed
    a graph (the capture's included)."""
    g = llm.engine.runner.drafting_graphs
    assert g.graphs is not None and g.graphs.graphs, g.steps
    assert sum(g.steps) - sum(g.replays) == len(g.graphs.seen) < sum(g.steps) // 2, (g.steps, g.replays)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_gpu_drafting_steps_replay_graphs_and_equal_eager(tiny_model, random_head, method):  # noqa: F811
    """Greedy: the graphed steps equal the eager ones (enforce_eager) and plain decoding, sync
    and async; seeded sampling: sync equals async, both graphed."""
    folder, _ = tiny_model("llama")
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=30, temperature=0.9, seed=i, ignore_eos=True) for i in range(3)]
    spec = _spec(method, folder, random_head)
    runs = []
    for async_scheduling in (False, True):
        plain = _tokens(_llm(folder, "cuda", async_scheduling=async_scheduling).generate(PROMPTS, greedy))
        eager = _llm(folder, "cuda", async_scheduling=async_scheduling, enforce_eager=True, speculative_config=spec)
        assert _tokens(eager.generate(PROMPTS, greedy)) == plain
        assert _padded_steps(eager) == 0
        graphed = _llm(folder, "cuda", async_scheduling=async_scheduling, speculative_config=spec)
        assert _tokens(graphed.generate(PROMPTS, greedy)) == plain
        runs.append(_tokens(graphed.generate(PROMPTS, sampled)))
        _all_replayed(graphed)
        assert graphed.engine.stats()["spec_num_draft_tokens"] > 0
    assert runs[0] == runs[1]


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_gpu_the_8b_shape_replays_the_drafting_graph(method):
    """Dummy weights, bf16, one row, k = 4, synthetic acceptance 3 (the bench's arm): the
    published EAGLE-3 head size and a Llama-3.2-1B draft model; the decode steps replay
    graphs and emit (nearly) 4 tokens a step.  (Random bf16 weights leave near ties everywhere: no
    token equality with the eager engine's kernels here; the tiny fp32 test has it.)"""
    import os
    configs = os.path.join(os.path.dirname(__file__), "..", "slipstream", "bench", "configs")
    model = os.path.join(configs, "llama-3.1-8b-eagle3" if method == "eagle3" else "llama-3.2-1b", "config.json")
    llm = LLM(os.path.join(configs, "llama-3.1-8b"), load_format="dummy", device="cuda", max_model_len=2048,
              max_num_seqs=4, gpu_memory_utilization=0.8,
              speculative_config={"method": method, "model": model, "num_speculative_tokens": 4})
    llm.engine.set_bench_synthetic_acceptance(3)
    out = llm.generate([[128000, 100, 200]], SamplingParams(max_tokens=81, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 81
    _all_replayed(llm)
    stats = llm.engine.stats()
    # (3 a row-step, fewer only where max_tokens cuts the last step)
    assert stats["spec_num_accepted_tokens"] >= 2.5 * stats["spec_num_drafting_rows"] > 0, stats


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_an_all_greedy_step_takes_no_draft_probabilities(tiny_model, random_head, plain, method):  # noqa: F811
    """StepShape.greedy: a step whose rows all draw greedily drafts argmaxes and keeps no q
    (its acceptance compares drafts with the target's argmax): with the drafter's q buffers
    poisoned with NaN, greedy output still equals plain decoding in every loop and the buffers
    stay untouched; a step with a sampled row writes that row's q and runs the sampled rule,
    sync equal to async and to the eager path."""
    import torch

    folder, _ = tiny_model("llama")
    spec = _spec(method, folder, random_head)
    for enforce_eager, async_scheduling in ((True, False), (False, False), (False, True)):
        llm = _llm(folder, async_scheduling=async_scheduling, enforce_eager=enforce_eager, speculative_config=spec)
        drafter = llm.engine.runner.drafter
        drafter.probs.fill_(float("nan"))
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == plain
        assert llm.engine.stats()["spec_num_draft_tokens"] > 0
        assert torch.isnan(drafter.probs).all()
    mixed = [GREEDY, SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True), GREEDY]
    runs = []
    for enforce_eager, async_scheduling in ((True, False), (False, False), (False, True)):
        llm = _llm(folder, async_scheduling=async_scheduling, enforce_eager=enforce_eager, speculative_config=spec)
        runs.append(_tokens(llm.generate(PROMPTS, mixed)))
        probs = llm.engine.runner.drafter.probs
        assert torch.isfinite(probs).all() and (probs.sum(dim=-1) > 0.99).any()
    assert runs[0] == runs[1] == runs[2]
    assert runs[0][0] == plain[0] and runs[0][2] == plain[2]
