"""Speculative decoding with a draft model in the engine: greedy output token-identical to
speculation off with a different (random) draft model; the target as its own draft accepts
every draft, sync and async, through preemption; seeded sampling reproducible, sync ≡ async;
stop tokens, max_tokens and n=2 keep their meaning; a vocabulary mismatch is a one-line
error."""
import json
from pathlib import Path

import pytest

from slipstream import LLM, SamplingParams


def _prompts():
    return [[5, 6, 7, 8, 9, 10] * 3, [40, 41, 42, 43], [3, 1, 4, 1, 5, 9, 2, 6], [100, 101]]


def _draft(folder, k=3):
    return {"method": "draft_model", "model": folder, "num_speculative_tokens": k}


def _llm(folder, **kw):
    return LLM(folder, device="cpu", max_model_len=128, max_num_seqs=8, debug_kv=True, **kw)


def _tokens(outs):
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def random_draft(tiny_model, tmp_path_factory):
    """A draft of the target's family and vocabulary with other (dummy) weights: a config
    file alone, loaded with dummy weights."""
    folder, _ = tiny_model("llama")
    cfg = json.loads(Path(folder, "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    path = str(tmp_path_factory.mktemp("draft") / "draft.json")
    Path(path).write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_with_random_draft_equals_plain(tiny_model, random_draft, async_scheduling):
    folder, _ = tiny_model("llama")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = _tokens(_llm(folder, async_scheduling=async_scheduling).generate(_prompts(), params))
    llm = _llm(folder, async_scheduling=async_scheduling, speculative_config=_draft(random_draft))
    assert _tokens(llm.generate(_prompts(), params)) == plain
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > 0
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_target_as_its_own_draft_accepts_every_draft(tiny_model, async_scheduling, temperature):
    """q = p: every draft is accepted (greedy: the same argmax; sampled: u q(x) < p(x) = q(x))."""
    folder, _ = tiny_model("llama")
    params = SamplingParams(max_tokens=21, temperature=temperature, seed=7, ignore_eos=True)
    plain = _tokens(_llm(folder, async_scheduling=async_scheduling).generate(_prompts(), params))
    llm = _llm(folder, async_scheduling=async_scheduling, speculative_config=_draft(folder))
    spec = _tokens(llm.generate(_prompts(), params))
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > 0
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"], stats
    assert all(len(c[0]) == 21 for o in spec for c in o)
    if temperature == 0.0:
        assert spec == plain


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(tiny_model, random_draft):
    folder, _ = tiny_model("llama")
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)
    runs = [_tokens(_llm(folder, speculative_config=_draft(random_draft)).generate(_prompts(), params))
            for _ in range(2)]
    assert runs[0] == runs[1]
    other = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=4, ignore_eos=True)
    assert _tokens(_llm(folder, speculative_config=_draft(random_draft)).generate(_prompts(), other)) != runs[0]


@pytest.mark.slow
def test_sampled_sync_equals_async(tiny_model, random_draft):
    """The draft model drafts on the device after every step in both loops (all rows in one
    forward per draft position), so both verify the same drafts with the same q."""
    folder, _ = tiny_model("llama")
    params = [SamplingParams(max_tokens=20, temperature=0.9, seed=11 + i, ignore_eos=True) for i in range(4)]
    runs = [_tokens(_llm(folder, async_scheduling=a, speculative_config=_draft(random_draft))
                    .generate(_prompts(), params)) for a in (False, True)]
    assert runs[0] == runs[1]


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_recomputes_the_drafts_cache(tiny_model, async_scheduling):
    """A KV cache too small for every row: preempted requests recompute (the draft's KV with
    them; the tokens a prefix-cache hit skips are caught up from the host's tokens); the
    target as its own draft still accepts every draft."""
    folder, _ = tiny_model("llama")
    prompts = [[7 + i, 20 + i, 33 + i] * 6 for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    common = dict(async_scheduling=async_scheduling, num_kv_blocks=14, max_num_batched_tokens=64)
    plain = _tokens(_llm(folder, **common).generate(prompts, params))
    llm = _llm(folder, speculative_config=_draft(folder), **common)
    assert _tokens(llm.generate(prompts, params)) == plain
    stats = llm.engine.stats()
    assert llm.engine.scheduler.num_preemptions > 0
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"] > 0, stats


@pytest.mark.slow
def test_stops_max_tokens_and_n_keep_their_meaning(tiny_model, random_draft):
    folder, _ = tiny_model("llama")
    prompts = _prompts()
    full = _tokens(_llm(folder).generate(prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)))
    params = [SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[full[0][0][0][6]]),
              SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, n=2),
              SamplingParams(max_tokens=15, temperature=0, ignore_eos=True, logprobs=1)]
    for draft in (random_draft, folder):
        plain = _tokens(_llm(folder).generate(prompts, params))
        llm = _llm(folder, speculative_config=_draft(draft, k=4))
        assert _tokens(llm.generate(prompts, params)) == plain
        assert llm.engine.pool.num_free == llm.engine.pool.num_blocks
    assert len(plain[0][0][0]) == 7 and plain[0][0][1] == "stop"
    assert len(plain[2]) == 2


def test_vocab_mismatch_is_refused(tiny_model, tmp_path):
    folder, _ = tiny_model("llama")
    cfg = json.loads(Path(folder, "config.json").read_text())
    cfg["vocab_size"] += 8
    path = str(tmp_path / "draft.json")
    Path(path).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="vocab"):
        _llm(folder, speculative_config=_draft(path))


@pytest.mark.gpu
def test_smollm2_as_its_own_draft_on_the_gpu():
    """On a CUDA GPU, fp32: SmolLM2 drafting for itself gives plain decoding's greedy tokens
    and accepts (nearly) every draft (the draft's one-token steps run the decode kernels, the
    verification the prefill path: rounding may part them rarely), sync and async settings;
    seeded sampling is reproducible."""
    from slipstream.model.loader import resolve_model_source

    draft = _draft(resolve_model_source(None), k=4)
    prompts = ["The history of the Roman Empire", "def fibonacci(n):", "List: red, green, blue,"]
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=40, temperature=0.8, seed=i, ignore_eos=True) for i in range(3)]
    common = dict(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=4)
    for async_scheduling in (False, True):
        plain = _tokens(LLM(async_scheduling=async_scheduling, **common).generate(prompts, greedy))
        llm = LLM(async_scheduling=async_scheduling, speculative_config=draft, **common)
        assert _tokens(llm.generate(prompts, greedy)) == plain
        first = _tokens(llm.generate(prompts, sampled))
        assert _tokens(llm.generate(prompts, sampled)) == first
        stats = llm.engine.stats()
        assert stats["spec_num_accepted_tokens"] >= 0.95 * stats["spec_num_draft_tokens"] > 0, stats


def test_the_drafts_are_the_draft_models_own_greedy_continuation(tiny_model, random_draft):
    """After a prompt's prefill step, the drafts buffered for its row are the draft model's
    greedy continuation of the prompt and the target's token, as the draft model decodes
    them alone."""
    folder, _ = tiny_model("llama")
    prompt, k = [5, 17, 99, 3, 42, 7, 7, 130, 64], 3
    llm = _llm(folder, speculative_config=_draft(random_draft, k=k))
    token = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    drafter = llm.engine.runner.drafter
    row = int((drafter.next_pos == len(prompt) + 1).nonzero()[0, 0])
    alone = LLM(random_draft, device="cpu", max_model_len=128, load_format="dummy")
    want = alone.generate([prompt + list(token)], SamplingParams(max_tokens=k, temperature=0, ignore_eos=True))
    assert drafter.drafts[row].tolist() == list(want[0].outputs[0].token_ids)
