"""Structured outputs on a CUDA GPU (marked `gpu`): constrained steps replay their split graphs
(runner/split_graphs.py: a forward graph at launch, a sampling graph after the bitmask's copy)
and give the tokens of the eager engine, greedy and seeded; async equals sync; batches without
constrained rows keep their graphs and allocate nothing new."""
import pytest
import torch
from test_structured_outputs_engine import assert_follows, constraints

from slipstream import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.gpu

PROMPTS = ["Tell me about a pet:", "List:", "Go", "Answer me", "Count:", "free text please",
           "Another pet, please:", "More"]


def workload(temperature: float, top_p: float = 1.0) -> list[SamplingParams]:
    """Five constraints, then a free row, then two more constrained rows: constrained decode and
    mixed steps of several padded sizes (prompts of different lengths, rows ending apart)."""
    cs = constraints()
    cs = cs + [None] + cs[:2]
    return [SamplingParams(max_tokens=32, temperature=temperature, top_p=top_p, seed=7 + i, structured_outputs=c)
            for i, c in enumerate(cs)]


def generate(llm: LLM, params: list[SamplingParams]):
    outs = llm.generate(PROMPTS, params)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def opts(**kw):
    return dict(device="cuda", max_model_len=256, max_num_seqs=8, **kw)


def split_replays(llm: LLM) -> dict:
    return llm.engine.runner.split_graphs.replays


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_constrained_steps_under_graphs_equal_the_eager_engine(tokenized_tiny, temperature):
    params = workload(temperature)
    eager = LLM(tokenized_tiny, enforce_eager=True, dtype="float32", **opts())
    ref = generate(eager, params)
    del eager
    torch.cuda.empty_cache()
    for async_scheduling in (False, True):
        llm = LLM(tokenized_tiny, dtype="float32", async_scheduling=async_scheduling, **opts())
        got = generate(llm, params)
        assert got == ref, async_scheduling
        for (tokens, reason), p in zip(got, params):
            if p.structured_outputs is not None:
                assert_follows(llm, p.structured_outputs, tokens, reason)
        replays = split_replays(llm)
        assert min(replays["forward"]) > 0 and min(replays["sample"]) > 0, replays  # both slots
        keys = llm.engine.runner.split_graphs.graphs
        assert any(k[0] == "forward" and not k[2] for k in keys), "a mixed step's forward graph"
        assert any(k[0] == "forward" and k[2] for k in keys), "a decode step's forward graph"
        del llm
        torch.cuda.empty_cache()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_constrained_async_equals_sync_bf16_with_graphs(tokenized_tiny, temperature):
    params = workload(temperature)
    results = {}
    for async_scheduling in (False, True):
        llm = LLM(tokenized_tiny, dtype="bfloat16", async_scheduling=async_scheduling, **opts())
        results[async_scheduling] = generate(llm, params)
        assert min(split_replays(llm)["sample"]) > 0
        del llm
        torch.cuda.empty_cache()
    assert results[True] == results[False]


def test_top_p_constrained_sampling_graph_at_second_use(tokenized_tiny):
    params = workload(0.8, top_p=0.9)
    ref = generate(LLM(tokenized_tiny, enforce_eager=True, dtype="float32", **opts()), params)
    llm = LLM(tokenized_tiny, dtype="float32", async_scheduling=True, **opts())
    assert generate(llm, params) == ref
    keys = llm.engine.runner.split_graphs.graphs
    assert any(k[0] == "sample" and k[3] for k in keys), "a top-k/top-p sampling graph"


def test_unconstrained_batches_keep_their_graphs_and_buffers(tokenized_tiny):
    llm = LLM(tokenized_tiny, dtype="bfloat16", async_scheduling=True, **opts())
    runner = llm.engine.runner
    startup = set(runner.graphs.graphs)
    llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert runner.split_graphs.graphs == {} and runner.slots[0].sample_hidden is None
    assert runner.slots[0]._bitmask is None and set(runner.graphs.graphs) == startup
    assert min(runner.graph_replays["decode"]) > 0


def test_min_tokens_and_a_grammar_that_can_only_stop_under_graphs(tokenized_tiny):
    llm = LLM(tokenized_tiny, dtype="float32", async_scheduling=True, **opts())
    done = SamplingParams(max_tokens=20, min_tokens=10, temperature=0,
                          structured_outputs=StructuredOutputsParams(choice=["yes"]))
    free = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)
    outs = llm.generate(["one", "two"], [done, free])
    assert (outs[0].outputs[0].text, outs[0].outputs[0].finish_reason) == ("yes", "stop")
    assert len(outs[1].outputs[0].token_ids) == 8
