"""On a CUDA GPU: the device drafters (EAGLE-3 head, draft model) in the engine, fp32 tiny
models (head_dim 16, as the Triton attention takes): greedy output equals plain decoding,
sync and async; a head that copies a bigram target and a target drafting for itself accept
(nearly) every draft; seeded sampling is the same in both loops; the 8B shape with an EAGLE-3
head of the published size and a Llama-3.2-1B-shaped draft model runs a few steps."""
import os

import pytest

from slipstream import LLM, SamplingParams
from test_spec_eagle3_engine import _eagle, _prompts, _tokens, bigram, random_head  # noqa: F401 (fixtures)

pytestmark = pytest.mark.gpu

COMMON = dict(device="cuda", dtype="float32", max_model_len=128, max_num_seqs=8)


def _draft(folder, k=3):
    return {"method": "draft_model", "model": folder, "num_speculative_tokens": k}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_copying_head_accepts_every_draft_on_the_gpu(bigram, async_scheduling):  # noqa: F811
    target, head = bigram
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = _tokens(LLM(target, async_scheduling=async_scheduling, **COMMON).generate(_prompts(), greedy))
    llm = LLM(target, async_scheduling=async_scheduling, speculative_config=_eagle(head, k=4), **COMMON)
    assert _tokens(llm.generate(_prompts(), greedy)) == plain
    stats = llm.engine.stats()
    # (the verification's prefill path and the plain decode kernel round differently: rarely a near tie parts them)
    assert stats["spec_num_accepted_tokens"] >= 0.95 * stats["spec_num_draft_tokens"] > 0, stats


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_random_drafters_keep_greedy_and_sync_equals_async(tiny_model, random_head, method):  # noqa: F811
    folder, _ = tiny_model("llama")
    spec = _eagle(random_head) if method == "eagle3" else _draft(folder)
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=30, temperature=0.9, seed=i, ignore_eos=True) for i in range(4)]
    plain = _tokens(LLM(folder, **COMMON).generate(_prompts(), greedy))
    runs = []
    for async_scheduling in (False, True):
        llm = LLM(folder, async_scheduling=async_scheduling, speculative_config=spec, **COMMON)
        assert _tokens(llm.generate(_prompts(), greedy)) == plain
        runs.append(_tokens(llm.generate(_prompts(), sampled)))
        assert llm.engine.stats()["spec_num_draft_tokens"] > 0
    assert runs[0] == runs[1]


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_the_8b_shape_with_published_drafter_sizes_runs(method):
    """Dummy weights, bf16, 8 rows: the published EAGLE-3 head of Llama-3.1-8B (hidden 4096,
    draft vocabulary 32000, max_position_embeddings 2048 < max_model_len) and a Llama-3.2-1B
    draft model, synthetic acceptance off: a few steps with drafts, greedy."""
    configs = os.path.join(os.path.dirname(__file__), "..", "slipstream", "bench", "configs")
    model = os.path.join(configs, "llama-3.1-8b-eagle3" if method == "eagle3" else "llama-3.2-1b", "config.json")
    llm = LLM(os.path.join(configs, "llama-3.1-8b"), load_format="dummy", device="cuda", max_model_len=4096,
              max_num_seqs=8, gpu_memory_utilization=0.8,
              speculative_config={"method": method, "model": model, "num_speculative_tokens": 3})
    outs = llm.generate([[128000, 100 + i, 200 + i] for i in range(8)],
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0
