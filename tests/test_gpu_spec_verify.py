"""The verification step on the GPU (marked `gpu`): the verify attention kernel against the
reference at the model shapes, the captured verify step against the same step run eagerly,
and an engine whose verification steps replay their graphs giving plain decoding's tokens."""
import os
import sys
from dataclasses import replace

import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.bench.workloads import CONFIGS
from slipstream.ops.attention import paged_attention_ref
from slipstream.ops.kv_quant import KVScales
from slipstream.ops.triton_attention import paged_attention_triton
from slipstream.runner.graphs import StepGraphs, capture_sizes
from slipstream.runner.speculative import spec_buffers, verify_step
from slipstream.runner.verify_graphs import verify_inputs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from test_attention_kernels import make_batch  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (16, 8), (8, 8)])
@pytest.mark.parametrize("k", [1, 3, 4, 7])
def test_verify_kernel_on_cuda(dtype, heads, kv_heads, k):
    """Rows of k + 1 tokens and fewer, contexts across tiles and splits, the production tiles;
    the heuristic's splits and forced ones."""
    q_len = k + 1
    seqs = [(q_len, q_len), (513, q_len), (97, 2), (1500, q_len), (0, q_len), (64, 1), (4100, q_len)]
    q, kc, vc, meta = make_batch(seqs, kv_heads, heads // kv_heads, 128, 16, dtype, seed=k, device="cuda")
    meta = replace(meta, verify_len=q_len)
    expected = paged_attention_ref(q, kc, vc, meta, 128 ** -0.5)
    for splits in (None, 1, 5):
        out = paged_attention_triton(q, kc, vc, meta, 128 ** -0.5, num_splits=splits)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
        assert (meta.split_counters == 0).all()


@pytest.mark.parametrize("window", [None, 256])
def test_verify_kernel_fp8_and_window_on_cuda(window):
    q, kc, vc, meta = make_batch([(700, 5), (130, 5), (5, 3)], 8, 4, 128, 16, torch.bfloat16, seed=1, device="cuda")
    meta = replace(meta, verify_len=5)
    sc = KVScales(0.03, 0.02)
    kc8 = (kc.nan_to_num(0.0) / sc.k_scale).to(torch.float8_e4m3fn)
    vc8 = (vc.nan_to_num(0.0) / sc.v_scale).to(torch.float8_e4m3fn)
    expected = paged_attention_ref(q, kc8, vc8, meta, 128 ** -0.5, window, kv_scales=sc)
    out = paged_attention_triton(q, kc8, vc8, meta, 128 ** -0.5, window=window, kv_scales=sc)
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("synthetic", [None, 2])
def test_graph_verify_equals_eager_verify(synthetic):
    """The padded verify step (0.6B shape, dummy weights) run eagerly and as a captured graph,
    on the same inputs: the same emitted tokens and counts, token for token."""
    import bench_verify_step as b
    core = b.engine(os.path.join(CONFIGS, "qwen3-0.6b"), "cuda", 8, 512, 4)
    runner = core.runner
    graphs = StepGraphs(capture_sizes(8), [], 8, runner.max_model_len)
    graphs.pool = torch.cuda.graph_pool_handle()
    slot = runner.slots[0]
    k = 4
    bufs, vin = spec_buffers(runner, 0, k), verify_inputs(runner, 0, k)
    with torch.inference_mode():
        shape = b.fill(runner, slot, 8, k + 1, 400, k)
        verify_step(runner, slot, shape, bufs, vin, synthetic)
        torch.cuda.synchronize()
        eager = (bufs.tokens[:8].clone(), bufs.num_emitted[:8].clone(), slot.dev.tokens[:8].clone())
        b.fill(runner, slot, 8, k + 1, 400, k)
        with torch.cuda.stream(runner.streams.compute):
            graph = graphs.capture_work(runner, lambda: verify_step(runner, slot, shape, bufs, vin, synthetic))
            bufs.tokens.fill_(-7)
            graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(bufs.tokens[:8], eager[0]) and torch.equal(bufs.num_emitted[:8], eager[1])
    assert torch.equal(slot.dev.tokens[:8], eager[2])
    if synthetic:
        assert (eager[1] == synthetic + 1).all()


def test_engine_verify_steps_replay_their_graphs():
    """n-gram drafting (fp32: the verify kernel and the decode kernel round alike enough),
    sync and async: plain decoding's tokens, and verification steps replayed from graphs."""
    copy = ("Copy the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape.\n"
            "Copy: apple, banana, cherry, date, elderberry, fig, grape.\nList: red, green, blue, "
            "yellow, purple, orange, black, white.\nCopy:")
    prompts = [copy, copy.replace("red", "cyan")]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    common = dict(device="cuda", dtype="float32", max_model_len=512, max_num_seqs=8)
    for async_scheduling in (False, True):
        plain = [o.outputs[0].token_ids for o in LLM(async_scheduling=async_scheduling, **common).generate(prompts, params)]
        llm = LLM(async_scheduling=async_scheduling, speculative_config=ngram, **common)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
        assert all(n > 0 for n in llm.engine.runner.verify_graphs.replays)  # both slots (one cloned)
        assert llm.engine.stats()["spec_num_accepted_tokens"] > 10
        del llm
