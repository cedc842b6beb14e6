"""Speculative decoding with an EAGLE-3 head in the engine, on tiny random targets: greedy
output token-identical to speculation off with a random head, sync ≡ async (greedy and seeded
sampling), seeded runs reproducible, stop tokens / max_tokens / n / logprobs and preemption
keep their meaning; a head built to copy a bigram target accepts (nearly) every draft, which
shows acceptance is computed from the head's drafts."""
import json

import pytest
import torch
from safetensors.torch import save_file

from slipstream import LLM, SamplingParams

V, H, NH = 256, 64, 4  # the tiny Llama's vocabulary and width (tests/helpers.py)


def _head_config(draft_vocab: int, num_kv_heads: int) -> dict:
    layer = {"hidden_size": H, "intermediate_size": 96, "num_attention_heads": NH,
             "num_key_value_heads": num_kv_heads, "rms_norm_eps": 1e-5, "vocab_size": V,
             "max_position_embeddings": 512, "rope_theta": 10000.0, "hidden_act": "silu", "model_type": "llama"}
    # the tiny target has 2 layers: the field's default (2, L/2, L-3) does not exist there
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": layer, "draft_vocab_size": draft_vocab, "target_hidden_size": H,
            "eagle_aux_hidden_state_layer_ids": [0, 1, 1]}


@pytest.fixture(scope="module")
def random_head(tmp_path_factory):
    """A random head (dummy weights from its config alone), draft vocabulary 200 of 256."""
    path = tmp_path_factory.mktemp("eagle") / "head.json"
    path.write_text(json.dumps(_head_config(200, 2)))
    return str(path)


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    """(target folder, head folder): a target whose layers add nothing to the residual stream
    (o_proj and down_proj zero), so its next token is a function of the current one, and a
    head that computes that function of the token it reads: its attention puts (almost) all
    weight on the current position and passes the normed embedding through (the hidden state
    it reads is normed away); its final norm and LM head are the target's."""
    from helpers import make_hf_model

    hf = make_hf_model("llama", str(tmp_path_factory.mktemp("random")), seed=5)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    target = str(tmp_path_factory.mktemp("bigram"))
    hf.save_pretrained(target)
    eye, zero = torch.eye(H), torch.zeros(H, H)
    sd = {"embed_tokens.weight": hf.model.embed_tokens.weight.detach().clone(),
          "lm_head.weight": hf.lm_head.weight.detach().clone(),
          "norm.weight": hf.model.norm.weight.detach().clone(),
          "fc.weight": torch.zeros(H, 3 * H), "d2t": torch.zeros(V, dtype=torch.long)}
    layer = "layers.0."
    # q = k = a constant vector u in RoPE's three fastest rotating pairs of each head:
    # q_t . k_s = a^2 (cos(d) + cos(0.32 d) + cos(0.1 d)), d = t - s, is largest at d = 0 by
    # 0.1 x 3 a^2 or more for d < 200, so each position attends to itself; v passes the token
    u = torch.zeros(H // NH)
    u[:3] = 20.0
    for name, w, b in (("q_proj", zero, u.repeat(NH)), ("k_proj", zero, u.repeat(NH)), ("v_proj", eye, None)):
        sd[layer + f"self_attn.{name}.weight"] = torch.cat([w, zero], dim=1)
        sd[layer + f"self_attn.{name}.bias"] = torch.zeros(H) if b is None else b
    sd[layer + "self_attn.o_proj.weight"] = eye.clone()
    sd[layer + "self_attn.o_proj.bias"] = torch.zeros(H)  # (attention_bias: o_proj has one too)
    for name, shape in (("gate_proj", (96, H)), ("up_proj", (96, H)), ("down_proj", (H, 96))):
        sd[layer + f"mlp.{name}.weight"] = torch.zeros(shape)
    for name in ("input_layernorm", "post_attention_layernorm"):
        sd[layer + f"{name}.weight"] = torch.ones(H)
    # the hidden state it reads (fc's, then its own output's) is normed to 0: with
    # norm_before_residual the residual stream starts at 0, so only the token counts
    sd[layer + "hidden_norm.weight"] = torch.zeros(H)
    head = tmp_path_factory.mktemp("copy-head")
    cfg = {**_head_config(V, NH), "norm_before_residual": True}
    cfg["transformer_layer_config"]["attention_bias"] = True
    (head / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(head / "model.safetensors"))
    return target, str(head)


def _prompts():
    return [[5, 6, 7, 8, 9, 10] * 3, [40, 41, 42, 43], [3, 1, 4, 1, 5, 9, 2, 6], [100, 101]]


def _eagle(head, k=3):
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k}


def _llm(folder, **kw):
    kw.setdefault("max_model_len", 128)
    return LLM(folder, device="cpu", max_num_seqs=8, debug_kv=True, **kw)


def _tokens(outs):
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_with_a_random_head_equals_plain(tiny_model, random_head, async_scheduling):
    folder, _ = tiny_model("llama")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = _tokens(_llm(folder, async_scheduling=async_scheduling).generate(_prompts(), params))
    llm = _llm(folder, async_scheduling=async_scheduling, speculative_config=_eagle(random_head))
    assert _tokens(llm.generate(_prompts(), params)) == plain
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > 0
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


@pytest.mark.slow
def test_sampled_sync_equals_async_and_seeds_reproduce(tiny_model, random_head):
    """The head drafts on the device at the end of each step in both loops, so both verify
    the same drafts with the same q: the same tokens under the same seeds."""
    folder, _ = tiny_model("llama")
    params = [SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=3 + i, ignore_eos=True)
              for i in range(4)]
    runs = [_tokens(_llm(folder, async_scheduling=a, speculative_config=_eagle(random_head))
                    .generate(_prompts(), params)) for a in (False, True, False)]
    assert runs[0] == runs[1] == runs[2]
    other = [SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=30 + i, ignore_eos=True)
             for i in range(4)]
    assert _tokens(_llm(folder, speculative_config=_eagle(random_head)).generate(_prompts(), other)) != runs[0]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_head_that_copies_the_target_accepts_its_drafts(bigram, async_scheduling):
    target, head = bigram
    greedy = SamplingParams(max_tokens=25, temperature=0, ignore_eos=True)
    plain = _tokens(_llm(target, async_scheduling=async_scheduling).generate(_prompts(), greedy))
    llm = _llm(target, async_scheduling=async_scheduling, speculative_config=_eagle(head, k=4))
    assert _tokens(llm.generate(_prompts(), greedy)) == plain
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > 0
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"], stats
    assert stats["spec_mean_accepted_length"] > 4.0  # (the last step of a row may cut its drafts)
    # sampled: q equals p up to rounding, so u q(x) < p(x) almost always
    llm = _llm(target, async_scheduling=async_scheduling, speculative_config=_eagle(head, k=4))
    sampled = [SamplingParams(max_tokens=25, temperature=0.8, seed=i, ignore_eos=True) for i in range(4)]
    llm.generate(_prompts(), sampled)
    stats = llm.engine.stats()
    assert stats["spec_num_accepted_tokens"] >= 0.95 * stats["spec_num_draft_tokens"] > 0, stats


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stops_max_tokens_n_and_logprobs_keep_their_meaning(tiny_model, random_head, bigram, async_scheduling):
    folder, _ = tiny_model("llama")
    prompts = _prompts()
    full = _tokens(_llm(folder).generate(prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)))
    params = [SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[full[0][0][0][6]]),
              SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, n=2),
              SamplingParams(max_tokens=15, temperature=0, ignore_eos=True, logprobs=1)]
    plain = _llm(folder, async_scheduling=async_scheduling).generate(prompts, params)
    llm = _llm(folder, async_scheduling=async_scheduling, speculative_config=_eagle(random_head, k=4))
    spec = llm.generate(prompts, params)
    assert _tokens(spec) == _tokens(plain)
    assert len(plain[1].outputs[0].token_ids) == 7 and plain[0].outputs[0].finish_reason == "stop"
    want = [lp[t] for lp, t in zip(plain[3].outputs[0].logprobs, plain[3].outputs[0].token_ids)]
    got = [lp[t] for lp, t in zip(spec[3].outputs[0].logprobs, spec[3].outputs[0].token_ids)]
    for a, b in zip(got, want):
        assert getattr(a, "logprob", a) == pytest.approx(getattr(b, "logprob", b), abs=1e-4)
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_rebuilds_the_heads_cache(bigram, async_scheduling):
    """A KV cache too small for every row: preempted requests recompute from 0 (the head's
    KV with them) and still accept the copying head's drafts; tokens equal plain decoding's."""
    target, head = bigram
    prompts = [[7 + i, 20 + i, 33 + i] * 6 for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    common = dict(async_scheduling=async_scheduling, num_kv_blocks=14, max_num_batched_tokens=64)
    plain = _tokens(_llm(target, **common).generate(prompts, params))
    llm = _llm(target, speculative_config=_eagle(head, k=3), **common)
    assert _tokens(llm.generate(prompts, params)) == plain
    stats = llm.engine.stats()
    assert llm.engine.scheduler.num_preemptions > 0
    assert stats["spec_num_accepted_tokens"] >= 0.9 * stats["spec_num_draft_tokens"] > 0, stats


def test_a_head_that_does_not_fit_the_target_is_refused(tiny_model, tmp_path):
    folder, _ = tiny_model("llama")
    cfg = _head_config(200, 2)
    cfg["target_hidden_size"] = 48
    path = tmp_path / "head.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="target hidden states of size 48"):
        _llm(folder, speculative_config=_eagle(str(path)))
    cfg = _head_config(200, 2)
    cfg["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="the target has 2 layers"):
        _llm(folder, speculative_config=_eagle(str(path)))


@pytest.mark.slow  # a bench run of two engines a case
@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_bench_synthetic_acceptance_with_device_drafters(tiny_model, random_head, tmp_path, monkeypatch, method):
    """`slipstream bench --spec-synthetic-accept A` with the EAGLE-3 head and a draft model:
    every drafting row-step emits A + 1 tokens, both loops (the lead's tokens/s against
    tokens-per-step curves, benchmarks/gpu_run.sh spec-e2e)."""
    from slipstream.bench import workloads
    from slipstream.cli.main import main

    folder, _ = tiny_model("llama")
    model = random_head if method == "eagle3" else folder
    prompts = [[7 * i + j + 3 for j in range(6)] for i in range(4)]
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True) for _ in prompts]
    monkeypatch.setitem(workloads.WORKLOADS, "synthetic-unit", lambda: workloads.Workload(
        "synthetic-unit", folder, prompts, params, dict(max_num_seqs=4, max_model_len=128)))
    flag = json.dumps({"method": method, "model": model, "num_speculative_tokens": 3})
    assert main(["bench", "--workload", "synthetic-unit", "--device", "cpu", "--speculative-config", flag,
                 "--spec-synthetic-accept", "2", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "synthetic-unit.json").read_text())
    for mode in ("sync", "async"):
        s = summary["results"][mode]["speculation"]
        assert s["drafted"] > 0 and s["mean_accepted_length"] == 3.0, (mode, s)


def test_the_heads_drafts_equal_a_reference_from_the_targets_hidden_states(tiny_model, random_head):
    """After a prompt's prefill step, the drafts buffered for its row are those of the head run
    by hand: the target's hidden states at layers (0, 1, 1) over the prompt, the head over
    them with each position reading the next token (the prompt's, then the sampled one), then
    k greedy steps feeding each draft back with the head's own output."""
    from slipstream.model.eagle3 import AuxHiddenCapture
    from slipstream.model.eagle3_loader import load_eagle3
    from slipstream.model.loader import load_model
    from slipstream.ops.metadata import AttentionMetadata

    folder, _ = tiny_model("llama")
    prompt = [5, 17, 99, 3, 42, 7, 7, 130, 64]
    P, k = len(prompt), 3
    llm = _llm(folder, speculative_config=_eagle(random_head, k=k))
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    drafter = llm.engine.runner.drafter
    row = int((drafter.next_pos == P + 1).nonzero()[0, 0])
    got = drafter.drafts[row].tolist()

    def meta(start, n):
        return AttentionMetadata(torch.tensor([0, n], dtype=torch.int32), torch.tensor([start + n], dtype=torch.int32),
                                 torch.arange(4, dtype=torch.int32)[None], torch.arange(start, start + n, dtype=torch.int32),
                                 n, start + n)

    target, _ = load_model(folder, "auto", torch.float32, "cpu")
    head = load_eagle3(random_head, "dummy", torch.float32, "cpu")
    ids = torch.tensor(prompt, dtype=torch.int32)
    kv = [(torch.zeros(4, 16, 2, 16), torch.zeros(4, 16, 2, 16)) for _ in range(2)]
    head_kv = (torch.zeros(4, 16, 2, 16), torch.zeros(4, 16, 2, 16))
    with torch.no_grad():
        with AuxHiddenCapture(target, (0, 1, 1)) as capture:
            token = int(target.compute_logits(target(ids, torch.arange(P), meta(0, P), kv)[-1:]).argmax())
        assert token == out[0].outputs[0].token_ids[0]
        nxt = torch.tensor(prompt[1:] + [token], dtype=torch.int32)
        normed, pre = head(nxt, torch.arange(P), head.combine_hidden_states(capture.aux()), meta(0, P), head_kv)
        normed, hidden, want = normed[-1:], pre[-1:], []
        for i in range(k):
            want.append(int(head.target_logits(normed).argmax()))
            normed, hidden = head(torch.tensor([want[-1]], dtype=torch.int32), torch.tensor([P + i]), hidden,
                                  meta(P + i, 1), head_kv)
    assert got == want
