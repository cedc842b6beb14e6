"""Async (depth 2) and sync (depth 1) give identical tokens, text and finish reasons, on
the CPU where streams and events are no-ops but the one-step-ahead control flow runs."""
import pytest
from async_mix import make_tokenized_tiny_llama, mix, run_mix

from slipstream import LLM


@pytest.fixture(scope="module")
def tokenized_tiny(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny-tok"))
    make_tokenized_tiny_llama(folder)
    return folder


def test_async_equals_sync_on_a_mixed_workload(tokenized_tiny):
    reqs = mix(tokenized_tiny)
    assert len(reqs) >= 24
    common = dict(device="cpu", max_model_len=256, num_kv_blocks=24, max_num_batched_tokens=64,
                  max_num_seqs=12, debug_kv=True)
    sync = LLM(tokenized_tiny, async_scheduling=False, **common)
    asyn = LLM(tokenized_tiny, async_scheduling=True, **common)
    got_sync, got_async = run_mix(sync, reqs), run_mix(asyn, reqs)
    assert got_sync == got_async
    reasons = {r for _, _, r in got_sync.values()}
    assert reasons == {"stop", "length", "abort"}, reasons
    by_string = [r["id"] for r in reqs if r["params"].stop and got_sync[r["id"]][2] == "stop"]
    by_eos = [r["id"] for r in reqs if not r["params"].stop and got_sync[r["id"]][2] == "stop"]
    assert by_string and by_eos, "stop strings and EOS should each end some requests"
    for llm in (sync, asyn):
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.pool.num_hits > 0
        assert llm.engine.pool.num_free == llm.engine.pool.num_blocks  # nothing leaked


def test_async_drops_the_token_drawn_after_a_stop(tokenized_tiny):
    """The request is scheduled again before its stop token is seen; that draw is dropped."""
    llm = LLM(tokenized_tiny, device="cpu", max_model_len=256, async_scheduling=True)
    from slipstream import SamplingParams
    first = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    out = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=8, temperature=0,
                                                   stop_token_ids=[first.token_ids[1]]))[0]
    assert out.token_ids == first.token_ids[:2] and out.finish_reason == "stop"
    assert llm.engine.loop.num_batches > 3  # the pipeline did run ahead
