"""How many graphs a device drafter's decode steps capture over a long run, on the CPU.

A GPU runs each padded drafting step (runner/draft_graphs.py) as the replay of a graph keyed
by (slot, rows, k, sampler variant, decode split count, synthetic acceptance); the first
use of a key on either slot runs eagerly (compiling its kernels), every later use replays a
graph, captured (or copied from the other slot's) at the slot's first replay.  A key that
changes as the context grows, or a step that leaves the padded route, costs the host an
eager step (and on a GPU the compiles of kernels at shapes nothing ran before) every time.
Here the CPU runner gets stand-in graphs with the same keying: a capture records the step's
closure and a replay runs it again, as a CUDA graph replays what it captured (the Python
values of the capture's step, the buffers' current contents), and a real decode split
policy (on a small GPU's SM count, so that split counts vary).  Asserted over batch-1 runs
to the end of the context (the last steps have no draft slots: within 2k + 1 tokens of
max_model_len): every step after the prefill takes the padded route, one graph is captured
per slot and replayed every step after the first, and the greedy tokens equal plain
decoding's, so the replays hold no value of their capture's step.  A ragged batch of three
rows that end one after another captures at most a graph per (slot, padded rows, split
option).  On a GPU: the 8B shape with the bench's arm to the end of its context replays
every step but the first, no launch after the first steps slow."""
import pytest
from helpers import StandInSteps
from test_spec_eagle3_engine import _eagle, _tokens, random_head  # noqa: F401 (fixture)

from slipstream import LLM, SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10] * 3


def _llm(folder, spec, max_model_len, **kw):
    return LLM(folder, device="cpu", max_num_seqs=8, debug_kv=True, max_model_len=max_model_len,
               speculative_config=spec, **kw)


def _graphed(llm, num_sms: int = 2):
    """Stand-in graphs and a real split policy on the engine's CPU runner; its DraftingGraphs."""
    from dataclasses import replace

    import torch

    from slipstream.ops.attention_tuning import DEFAULT_DECODE_CONFIG, DecodeSplitPolicy
    from slipstream.ops.triton_attention import effective_decode_config
    from slipstream.runner.draft_graphs import DraftingGraphs
    from slipstream.runner.verify_graphs import VerifyGraphs

    runner = llm.engine.runner
    c = runner.model_config
    # chunks of 16 tokens: the short test contexts get several split counts, as long ones do
    cfg = replace(effective_decode_config(DEFAULT_DECODE_CONFIG, torch.bfloat16, c.head_dim, 1),
                  block_n=16, min_chunk=16)
    runner.split_policy = DecodeSplitPolicy(runner.num_kv_heads, runner.max_model_len, cfg, num_sms)
    runner.drafting_graphs = DraftingGraphs(VerifyGraphs(StandInSteps()))
    return runner.drafting_graphs


@pytest.fixture
def routes(monkeypatch):
    """(padded?, the batch's most new tokens a row) of every launch of a drafter engine."""
    from slipstream.runner import draft_step

    seen = []
    shape_of = draft_step.padded_drafting_shape

    def spy(runner, batch, slot):
        shape = shape_of(runner, batch, slot)
        seen.append((shape is not None, int(max(batch.num_new))))
        return shape

    monkeypatch.setattr(draft_step, "padded_drafting_shape", spy)
    return seen


def _method(method, folder, head, k=3):
    if method == "eagle3":
        return _eagle(head, k)
    return {"method": "draft_model", "model": folder, "num_speculative_tokens": k}


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_batch_one_to_the_end_of_the_context_replays_one_graph_a_slot(tiny_model, random_head, routes,  # noqa: F811
                                                                       method, async_scheduling):
    folder, _ = tiny_model("llama")
    new = 80
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    max_len = len(PROMPT) + new  # (the last steps have no draft slots)
    plain = _tokens(LLM(folder, device="cpu", max_num_seqs=8, max_model_len=max_len,
                        async_scheduling=async_scheduling).generate([PROMPT], params))
    llm = _llm(folder, _method(method, folder, random_head), max_len, async_scheduling=async_scheduling)
    g = _graphed(llm)
    assert _tokens(llm.generate([PROMPT], params)) == plain
    steps = sum(g.steps)
    assert steps >= 15 and len(routes) == steps + 1, (steps, routes)
    assert not routes[0][0] and all(padded for padded, _ in routes[1:]), routes  # (the prefill: eager)
    assert any(n == 1 for _, n in routes[1:]) and any(n > 1 for _, n in routes[1:]), routes
    keys = sorted(g.graphs.graphs)
    assert [k[0] for k in keys] == [0, 1] and keys[0][1:] == keys[1][1:], keys  # one key, both slots
    assert keys[0][4] is not None, keys  # (the split policy's count is in it)
    # one eager step (the first), then every step replays
    assert g.graphs.steps.captures == 2 and len(g.graphs.seen) == 1
    assert steps - sum(g.replays) == 1, (g.steps, g.replays)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_the_bench_arm_and_a_ragged_batch_keep_their_captures_bounded(tiny_model, random_head, routes,  # noqa: F811
                                                                     method):
    """`--spec-synthetic-accept` (the bench's batch-1 arm: k tokens a step): 2 captures over the
    run; three rows of different lengths that end one after another (padded to 4, 2, 1 rows):
    at most a capture per (slot, padded rows, split option) and the rest replays."""
    folder, _ = tiny_model("llama")
    k = 4
    spec = _method(method, folder, random_head, k)
    llm = _llm(folder, spec, len(PROMPT) + 200, async_scheduling=True)
    llm.engine.set_bench_synthetic_acceptance(k - 1)
    g = _graphed(llm)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 200
    assert sum(g.steps) >= 45 and g.graphs.steps.captures == 2 and len(g.graphs.graphs) == 2, g.graphs.graphs
    assert all(padded for padded, _ in routes[1:])

    llm = _llm(folder, spec, 160, async_scheduling=True)
    g = _graphed(llm)
    prompts = [PROMPT, [40, 41, 42, 43] * 10, [3, 1, 4, 1, 5, 9, 2, 6]]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (100, 60, 30)]
    routes.clear()
    outs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [100, 60, 30]
    policy = llm.engine.runner.split_policy
    bound = 2 * sum(len(policy.options(p)) for p in (4, 2, 1))
    assert {key[1] for key in g.graphs.graphs} == {4, 2, 1}, g.graphs.graphs
    assert g.graphs.steps.captures == len(g.graphs.graphs) <= bound, (g.graphs.graphs, bound)
    assert {key[4] for key in g.graphs.graphs if key[1] == 4} <= set(policy.options(4))
    assert sum(g.replays) == sum(g.steps) - len(g.graphs.seen) and sum(g.steps) >= 15, (g.steps, g.replays)
    assert all(padded for padded, _ in routes[1:]), routes


# -- on a CUDA GPU ------------------------------------------------------------------------------

def _gpu_bench_arm(method, monkeypatch, new: int = 256):
    """seed-8b-bs1's shape and arm (dummy bf16 weights, a 256-token prompt, k = 4, synthetic
    acceptance 3, max_model_len = prompt + max_tokens): the engine, the prompt, and the list
    each launch's host time is appended to."""
    import os
    import random
    import time

    from slipstream.runner.model_runner import ModelRunner

    configs = os.path.join(os.path.dirname(__file__), "..", "slipstream", "bench", "configs")
    model = os.path.join(configs, "llama-3.1-8b-eagle3" if method == "eagle3" else "llama-3.2-1b", "config.json")
    rng = random.Random(0)
    prompt = [rng.randrange(128000) for _ in range(256)]
    llm = LLM(os.path.join(configs, "llama-3.1-8b"), load_format="dummy", device="cuda",
              max_model_len=len(prompt) + new, max_num_seqs=4, gpu_memory_utilization=0.8,
              speculative_config={"method": method, "model": model, "num_speculative_tokens": 4})
    llm.engine.set_bench_synthetic_acceptance(3)
    took = []
    launch = ModelRunner.launch

    def timed(self, batch):
        t = time.perf_counter()
        out = launch(self, batch)
        took.append(time.perf_counter() - t)
        return out

    monkeypatch.setattr(ModelRunner, "launch", timed)
    return llm, prompt, took


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_gpu_the_bench_arm_replays_to_the_end_of_the_context(routes, monkeypatch, method):
    """The bench's arm to the end of its context: every step after the prefill takes the
    padded route, all but the first replay a graph, and no launch after the first four takes
    the host more than 0.25 s (the eager steps at the context's end took 1.3-2 s each)."""
    new = 256
    llm, prompt, took = _gpu_bench_arm(method, monkeypatch, new)
    out = llm.generate([prompt], SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == new
    g = llm.engine.runner.drafting_graphs
    assert not routes[0][0] and all(padded for padded, _ in routes[1:]), routes
    assert any(n == 1 for _, n in routes[1:]), routes  # (the context's last steps)
    assert sum(g.steps) - sum(g.replays) == len(g.graphs.seen) == 1, (g.steps, g.replays, g.graphs.seen)
    assert max(took[4:]) < 0.25, sorted(took)[-5:]


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_gpu_an_eager_drafting_step_costs_the_host_milliseconds(monkeypatch, method):
    """The steps that stay eager (a prompt chunk, penalties, logprobs) take the same launch as
    the context-end steps did: forced onto it, the bench's arm's steps after the first few
    (which compile their kernels) take the host well under 0.1 s each.  (A diagnostic as much
    as a test: on the H100 the three eager steps at the context's end took 1.3-2 s each, and
    their cause was not found on the CPU.)"""
    from slipstream.runner import draft_step

    monkeypatch.setattr(draft_step, "padded_drafting_shape", lambda runner, batch, slot: None)
    llm, prompt, took = _gpu_bench_arm(method, monkeypatch, 64)
    out = llm.generate([prompt], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 64
    later = sorted(took[4:])
    assert len(later) >= 8 and later[len(later) // 2] < 0.1 and later[-1] < 0.25, [round(t, 3) for t in took]
