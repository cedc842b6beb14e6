"""Speculative decoding on a CUDA GPU (marked `gpu`): n-gram drafts give plain decoding's
tokens, greedy and seeded sampling, sync and async (device drafting: the next step launched
before the accepted counts are read back), with plain steps replaying their CUDA graphs
beside the eager verification steps."""
import pytest

from slipstream import LLM, SamplingParams

pytestmark = pytest.mark.gpu

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
COPY = ("Copy the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape.\n"
        "Copy: apple, banana, cherry, date, elderberry, fig, grape.\nList: red, green, blue, "
        "yellow, purple, orange, black, white.\nCopy:")


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("dtype,batch_invariant", [("float32", False), ("bfloat16", True)])
def test_smollm2_ngram_equals_plain_decoding_on_the_gpu(dtype, batch_invariant):
    """bf16 needs the batch-invariant kernels: a verification step runs a row's k + 1 tokens
    through the prefill attention and GEMMs, a plain step its one token through the decode
    kernels, which round differently; fp32's differences stay below the logits' gaps."""
    prompts = [COPY, "The history of the Roman Empire", COPY.replace("red", "cyan")]
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=48, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True) for i in range(3)]
    common = dict(device="cuda", dtype=dtype, max_model_len=512, max_num_seqs=8, batch_invariant=batch_invariant)
    for async_scheduling in (False, True):
        plain = LLM(async_scheduling=async_scheduling, **common)
        ref_greedy, ref_sampled = _tokens(plain, prompts, greedy), _tokens(plain, prompts, sampled)
        del plain
        llm = LLM(async_scheduling=async_scheduling, speculative_config=NGRAM, **common)
        assert _tokens(llm, prompts, greedy) == ref_greedy
        assert _tokens(llm, prompts, sampled) == ref_sampled
        stats = llm.engine.stats()
        assert stats["spec_num_accepted_tokens"] > 20 and stats["spec_mean_accepted_length"] > 1.5, stats
        del llm


def test_disabled_by_batch_size_replays_the_plain_graphs():
    """Above disable_by_batch_size the steps are plain ones: CUDA graphs, no drafts."""
    prompts = [COPY] * 6
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    llm = LLM(device="cuda", max_model_len=512, max_num_seqs=8, speculative_config=dict(NGRAM, disable_by_batch_size=4))
    plain = LLM(device="cuda", max_model_len=512, max_num_seqs=8)
    assert _tokens(llm, prompts, params) == _tokens(plain, prompts, params)
    assert llm.engine.stats()["spec_num_draft_tokens"] == 0
    assert sum(llm.engine.runner.graph_replays["decode"]) > 0
