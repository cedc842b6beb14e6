"""The async-equivalence mix (stop strings, EOS, min_tokens, top-k / top-p, shared prefixes
with prefix caching, staggered arrivals, aborts) in a KV cache small enough to preempt, with
the device drafters (a random EAGLE-3 head, the target as its own draft model): every request
that was not aborted gets plain decoding's tokens, text and finish reason, sync and async.
Greedy requests only: a drafter with probabilities keeps sampled output's distribution, not
its tokens (tests/test_spec_rejection.py checks the distribution)."""
import json
from pathlib import Path

import pytest

from slipstream import LLM


def _head(folder, tmp_path) -> str:
    cfg = json.loads(Path(folder, "config.json").read_text())
    layer = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                 "rms_norm_eps", "vocab_size", "max_position_embeddings")}
    layer["rope_theta"] = 10000.0  # (the head's own RoPE)
    head = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": {**layer, "model_type": "llama", "hidden_act": "silu"},
            "draft_vocab_size": 4096, "target_hidden_size": cfg["hidden_size"],
            "eagle_aux_hidden_state_layer_ids": [0, 1, 1]}
    path = tmp_path / "head.json"
    path.write_text(json.dumps(head))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_the_mix_with_preemption_prefix_hits_and_stop_strings(tokenized_tiny, tmp_path, method):
    from async_mix import mix, run_mix

    reqs = mix(tokenized_tiny, sampled=False)
    model = _head(tokenized_tiny, tmp_path) if method == "eagle3" else tokenized_tiny
    spec = {"method": method, "model": model, "num_speculative_tokens": 3}
    common = dict(device="cpu", max_model_len=256, num_kv_blocks=24, max_num_batched_tokens=64,
                  max_num_seqs=12, debug_kv=True)
    plain = run_mix(LLM(tokenized_tiny, async_scheduling=False, **common), reqs)
    aborted = {rid for rid, (_, _, reason) in plain.items() if reason == "abort"}
    for async_scheduling in (False, True):
        llm = LLM(tokenized_tiny, async_scheduling=async_scheduling, speculative_config=spec, **common)
        got = run_mix(llm, reqs)
        assert {r: v for r, v in got.items() if r not in aborted and v[2] != "abort"} == \
            {r: v for r, v in plain.items() if r not in aborted and r in got and got[r][2] != "abort"}
        assert len(got) == len(plain)
        stats = llm.engine.stats()
        assert stats["spec_num_draft_tokens"] > 0 and llm.engine.scheduler.num_preemptions > 0
        if method == "draft_model":  # the target drafting for itself (prefix hits caught up)
            assert stats["spec_num_accepted_tokens"] > 0.95 * stats["spec_num_draft_tokens"], stats
        while llm.engine.has_work():  # a step drawn past a request's end may still be in flight
            llm.engine.step()
        assert llm.engine.pool.num_free == llm.engine.pool.num_blocks
