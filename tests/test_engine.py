"""The engine end to end on the CPU: tokens against Hugging Face transformers, and the
features of a request (seeds, penalties, stops, min_tokens, logprobs, bad input)."""
import pytest
import torch
from helpers import TINY_MODELS, engine, hf_greedy, hf_logits, prompt

from slipstream import LLM, SamplingParams


GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("kind", list(TINY_MODELS))
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.quick_sample(1)
def test_greedy_equals_transformers_generate(tiny_model, kind, async_scheduling):
    folder, hf = tiny_model(kind)
    llm = engine(folder, async_scheduling=async_scheduling, max_num_batched_tokens=64, max_num_seqs=8)
    prompts = [prompt(5, 1), prompt(23, 2), prompt(70, 3)]  # 70 > 64: a chunked prefill
    outs = llm.generate(prompts, GREEDY)
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, p, 32)
        assert out.finish_reason == "length"


@pytest.mark.slow
def test_smollm2_greedy_equals_transformers_generate(smollm2_transformers):
    llm = LLM(device="cpu", async_scheduling=True, max_model_len=512)
    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
               tok.encode("The three primary colours are"), tok.encode("def add(a, b):")]
    outs = llm.generate(prompts, GREEDY)
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(smollm2_transformers, p, 32)
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(max_tokens=32, temperature=0))[0]
    assert chat.text == "The capital of France is Paris." and chat.finish_reason == "stop"


@pytest.mark.slow
def test_prefix_cache_chunked_prefill_and_preemption_do_not_change_outputs(tiny_model):
    folder, _ = tiny_model("llama")
    shared = prompt(40, 7)
    prompts = [shared + prompt(k, 10 + k) for k in (3, 9, 17, 1, 30, 12)] + [prompt(50, 99)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    base = engine(folder, enable_prefix_caching=False, async_scheduling=False)
    ref = [o.token_ids for o in base.generate(prompts, params)]

    cached = engine(folder, async_scheduling=True)
    cached.generate(prompts[:1], params)  # warm the cache with the shared prefix
    assert [o.token_ids for o in cached.generate(prompts, params)] == ref
    assert cached.engine.pool.num_hits > 0

    chunked = engine(folder, max_num_batched_tokens=8, max_num_seqs=8, async_scheduling=True)
    assert [o.token_ids for o in chunked.generate(prompts, params)] == ref

    # 20 blocks of 16 tokens: fewer than the 7 requests need at once
    small = engine(folder, num_kv_blocks=20, async_scheduling=True, debug_kv=True)
    assert [o.token_ids for o in small.generate(prompts, params)] == ref
    assert small.engine.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(tiny_model):
    folder, _ = tiny_model("qwen3")
    llm = engine(folder, async_scheduling=True)
    p = prompt(12, 5)
    sp = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([p], sp)[0].token_ids
    others = [prompt(30, 6), prompt(3, 7)]
    mixed = llm.generate([others[0], p, others[1]],
                         [SamplingParams(max_tokens=9, temperature=0.7, seed=1), sp, GREEDY])
    assert mixed[1].token_ids == alone
    other_seed = llm.generate([p], SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50,
                                                  seed=99, ignore_eos=True))[0].token_ids
    assert other_seed != alone
    unseeded = llm.generate([p, p], SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True))
    assert unseeded[0].token_ids != unseeded[1].token_ids  # each request draws its own seed


def _penalised(logits: torch.Tensor, prompt_ids, out_ids, rep, pres, freq) -> torch.Tensor:
    logits = logits.clone()
    seen = set(prompt_ids) | set(out_ids)
    for t in seen:
        logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
    for t in set(out_ids):
        logits[t] -= freq * out_ids.count(t) + pres
    return logits


def test_penalties_equal_a_direct_computation(tiny_model):
    folder, hf = tiny_model("llama")
    llm = engine(folder)
    p = prompt(10, 3)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
                        presence_penalty=0.4, frequency_penalty=0.6)
    got = llm.generate([p, prompt(6, 4)], [sp, GREEDY])[0].token_ids
    out = []
    for _ in range(16):
        logits = hf_logits(hf, p + out)[-1]
        out.append(int(_penalised(logits, p, out, 1.3, 0.4, 0.6).argmax()))
    assert got == out
    assert got != hf_greedy(hf, p, 16)  # the penalties did something


def test_min_tokens_masks_stop_tokens(tiny_model):
    folder, hf = tiny_model("qwen2")
    llm = engine(folder)
    p = prompt(8, 11)
    free = hf_greedy(hf, p, 6)
    stop = free[0]
    short = llm.generate([p], SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[stop]))[0]
    assert short.token_ids == [stop] and short.finish_reason == "stop"
    held = llm.generate([p], SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[stop],
                                            min_tokens=3))[0]
    masked = hf_logits(hf, p)[-1]
    masked[stop] = float("-inf")
    assert held.token_ids[0] == int(masked.argmax())
    assert stop not in held.token_ids[:3]


def test_logprobs_equal_log_softmax(tiny_model):
    folder, hf = tiny_model("mistral")
    llm = engine(folder, async_scheduling=True)
    p = prompt(9, 2)
    out = llm.generate([p], SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        ref = hf_logits(hf, p + out.token_ids[:i])[-1].log_softmax(-1)
        top = ref.topk(3)
        assert set(entry) == {tok} | set(top.indices.tolist())
        for t, lp in entry.items():
            assert lp == pytest.approx(ref[t].item(), abs=1e-4)
    only = llm.generate([p], SamplingParams(max_tokens=2, temperature=0, logprobs=0))[0]
    assert all(len(e) == 1 for e in only.logprobs)


@pytest.mark.slow
def test_stop_strings_are_trimmed_exactly():
    llm = LLM(device="cpu", max_model_len=512)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(chat, SamplingParams(max_tokens=32, temperature=0, stop=["Paris", "France is"]))[0]
    assert out.text == "The capital of " and out.finish_reason == "stop"


def test_bad_requests_get_their_own_error_and_the_others_go_on(tiny_model):
    folder, hf = tiny_model("llama")
    llm = engine(folder, max_model_len=64)
    good = prompt(5, 1)
    outs = llm.generate([prompt(60, 2), good, [], [3, 999999], [4, -5, 3]],
                        [SamplingParams(max_tokens=10), GREEDY, GREEDY, GREEDY, GREEDY])
    assert outs[0].finish_reason == "error" and "max_model_len=64" in outs[0].error
    assert outs[1].token_ids == hf_greedy(hf, good, 32)[:32]
    assert outs[2].finish_reason == "error" and "empty" in outs[2].error
    assert outs[3].finish_reason == "error" and "999999" in outs[3].error
    assert outs[4].finish_reason == "error" and "id -5 is outside" in outs[4].error
    with pytest.raises(TypeError, match="prompt"):
        llm.add_request([1, True])  # a bool is not a token id
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer")
    with pytest.raises(TypeError, match="prompt"):
        llm.generate([3.5])
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(folder, max_num_seq=3)


def test_a_request_larger_than_the_whole_kv_cache_fails_alone(tiny_model):
    folder, hf = tiny_model("llama")
    llm = engine(folder, num_kv_blocks=4)  # 64 tokens in all
    outs = llm.generate([prompt(50, 1), prompt(5, 2)],
                        [SamplingParams(max_tokens=30), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)])
    assert outs[0].finish_reason == "error" and "KV" in outs[0].error
    assert outs[1].token_ids == hf_greedy(hf, prompt(5, 2), 8)


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises((FileNotFoundError, ValueError), match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"), device="cpu")


def test_kv_cache_too_small_for_one_sequence_is_a_clear_error(tiny_model):
    folder, _ = tiny_model("llama")
    with pytest.raises(RuntimeError, match="does not fit.*max_model_len=512"):
        LLM(folder, device="cpu", max_model_len=512, cpu_kv_cache_gib=1e-6)
