"""The second IO slot's CUDA graphs cloned from the first slot's (runner/graph_clone.py) on
the GPU (marked `gpu`): every slot-1 graph is a clone, a clone writes its own slot's
tokens and leaves the other slot's alone, it gives the tokens of an eager step on the
same inputs, and engines with and without clones generate the same tokens (greedy,
seeded, lazily captured top-p graphs)."""
import numpy as np
import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.runner.graph_clone import ClonedGraph

pytestmark = pytest.mark.gpu

COMMON = dict(device="cuda", max_model_len=256, max_num_seqs=12, max_num_batched_tokens=64,
              async_scheduling=True)
CLONED = dict(COMMON, cuda_graph_clone=True)  # (the default, asked for here all the same)
CAPTURED = dict(COMMON, cuda_graph_clone=False)


# bf16 steps run cuBLAS kernels, whose launches pack their arguments in one buffer (`extra`)
DTYPES = pytest.mark.parametrize("dtype", ["float32", "bfloat16"])


@DTYPES
def test_every_second_slot_graph_is_a_clone(tiny_model, dtype):
    folder, _ = tiny_model("llama3")
    llm = LLM(folder, dtype=dtype, **CLONED)
    graphs = llm.engine.runner.graphs
    assert graphs.cloner is not None and graphs.cloner.unsupported is None
    by_slot = {0: [], 1: []}
    for key, graph in graphs.graphs.items():
        by_slot[key[0]].append(graph)
    assert by_slot[1] and len(by_slot[1]) == len(by_slot[0]) == graphs.cloner.cloned
    assert all(isinstance(g, ClonedGraph) and g.nodes_repointed > 0 for g in by_slot[1])
    assert not any(isinstance(g, ClonedGraph) for g in by_slot[0])
    assert llm.engine.startup["num_graphs_cloned"] == graphs.cloner.cloned


@DTYPES
def test_a_clone_writes_its_slots_tokens_as_an_eager_step_does(tiny_model, dtype):
    """For each shape captured at start: all-padding inputs in both slots, slot 0's tokens
    set to a token id and slot 1's to -1; slot 1's clone writes every one of slot 1's
    sampled rows (the tokens an eager step on those inputs writes) and none of slot 0's."""
    folder, _ = tiny_model("llama3")
    llm = LLM(folder, dtype=dtype, **CLONED)
    runner = llm.engine.runner
    graphs, (s0, s1), compute = runner.graphs, runner.slots, runner.streams.compute
    vocab = runner.model.config.vocab_size
    checked = 0
    for shape in graphs.startup_shapes():
        if not isinstance(graphs.graphs.get(graphs.key(1, shape)), ClonedGraph):
            continue
        n = shape.num_samples
        for slot in (s0, s1):
            runner.fill_padding(slot, shape)
        s0.dev.tokens.fill_(7)
        s1.dev.tokens.fill_(-1)
        torch.cuda.synchronize()
        with torch.cuda.stream(compute):
            graphs.replay(1, shape)
        torch.cuda.synchronize()
        cloned = s1.dev.tokens[:n].clone()
        assert ((cloned >= 0) & (cloned < vocab)).all(), (shape, cloned)
        assert (s0.dev.tokens == 7).all(), shape
        assert (s1.dev.tokens[n:] == -1).all(), shape  # rows past the step's are not written
        s1.dev.tokens.fill_(-1)
        runner.fill_padding(s1, shape)
        with torch.cuda.stream(compute):
            runner.compute_step(s1, shape)
        torch.cuda.synchronize()
        assert torch.equal(s1.dev.tokens[:n], cloned), shape
        checked += 1
    assert checked >= 4


@pytest.mark.parametrize("dtype,temperature,top_p", [("float32", 0.0, 1.0), ("float32", 0.8, 1.0),
                                                     ("float32", 0.8, 0.9), ("bfloat16", 0.8, 1.0)])
def test_clones_give_the_tokens_of_captured_graphs(tiny_model, dtype, temperature, top_p):
    """12 staggered requests, async (both slots replay): the same tokens with and without
    clones (the same kernels on the same batches: bit-equal in bf16 too); with top_p the
    lazily captured graphs of the second slot are clones too."""
    folder, _ = tiny_model("llama3")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 256, int(n)).tolist() for n in rng.integers(3, 60, 12)]
    params = [SamplingParams(max_tokens=int(m), temperature=temperature, top_p=top_p, seed=i, ignore_eos=True)
              for i, m in enumerate(rng.integers(4, 48, 12))]
    captured = LLM(folder, dtype=dtype, **CAPTURED)
    cloned = LLM(folder, dtype=dtype, **CLONED)
    assert captured.engine.runner.graphs.cloner is None and cloned.engine.runner.graphs.cloner.cloned > 0
    assert ([o.token_ids for o in cloned.generate(prompts, params)]
            == [o.token_ids for o in captured.generate(prompts, params)])
    graphs = cloned.engine.runner.graphs
    for llm in (captured, cloned):
        replays = llm.engine.runner.graph_replays
        assert min(replays["decode"]) > 0 and sum(replays["mixed"]) > 0, replays
    if top_p < 1.0:
        lazy = {k: g for k, g in graphs.graphs.items() if k[4]}
        assert lazy, "top-p graphs captured on their second use"
        pairs = [k for k in lazy if k[0] == 1 and (0,) + k[1:] in lazy]
        assert any(isinstance(lazy[k], ClonedGraph) or isinstance(lazy[(0,) + k[1:]], ClonedGraph)
                   for k in pairs), "a lazily captured shape used on both slots has a clone"


def test_the_small_256_engine_clones_every_second_slot_graph():
    """The Qwen3-0.6B-shaped engine of small-256 (bf16, dummy weights): its cuBLAS, Triton
    and torch kernels all re-point, so half its graphs are clones."""
    from slipstream.bench.workloads import get_workload
    from slipstream.config import EngineConfig
    from slipstream.core.engine_core import EngineCore
    w = get_workload("small-256")
    core = EngineCore(EngineConfig(model=w.model, load_format="dummy", **{**w.engine, "cuda_graph_clone": True}))
    cloner = core.runner.graphs.cloner
    assert cloner.unsupported is None
    assert core.startup["num_graphs"] == 2 * core.startup["num_graphs_cloned"] > 0
