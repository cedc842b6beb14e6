"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers on the same weights.

Tiny random models saved with save_pretrained (one safetensors tensor per expert and
projection): fp32 logits on a prompt and over a chunked prefill, greedy tokens through the
engine (sync and async), async equal to sync on sampled requests, two tensor-parallel ranks
equal to one (gloo) and each rank's expert slices, dummy weights from a config.json alone,
and the configs that are refused.
"""
from __future__ import annotations

import json

import pytest
import torch
from helpers import PagedModelRunner, hf_greedy, hf_logits

from slipstream import LLM, SamplingParams
from slipstream.model.config import ModelConfig
from slipstream.model.loader import load_model
from slipstream.model.moe import MoEForCausalLM
from slipstream.model.parallel import TPGroup, TPShard

_COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15,
               rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
# kind -> (config class, model class, overrides): Qwen3-MoE with q/k norms, head_dim 32 and
# top-3 weights left unnormalised; Mixtral renormalises its top 2
MOE_MODELS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=32, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                       num_experts_per_tok=3, norm_topk_prob=False, rope_theta=1000000.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=32, num_local_experts=6, num_experts_per_tok=2)),
}


def make_moe_model(kind: str, folder: str):
    """Save a tiny random fp32 MoE model of `kind` into `folder`; return the HF model."""
    import transformers

    config_cls, model_cls, overrides = MOE_MODELS[kind]
    config = getattr(transformers, config_cls)(**_COMMON, **overrides)
    torch.manual_seed(7)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):  # routers spread so that routing is far from ties
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module", params=list(MOE_MODELS))
def moe(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(request.param))
    return request.param, folder, make_moe_model(request.param, folder)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_logits_match_hf_with_a_chunked_prefill(moe):
    _, folder, hf = moe
    model, config = load_model(folder)
    assert isinstance(model, MoEForCausalLM) and config.is_moe
    prompt, other = _prompt(37, 1), _prompt(11, 2)
    runner = PagedModelRunner(model)
    first = runner.step([(0, prompt[:18])])
    second = runner.step([(0, prompt[18:]), (1, other)])  # over the cached 18, beside another
    ref = hf_logits(hf, prompt)
    _close(first, ref[:18])
    _close(second[:19], ref[18:])
    _close(second[19:], hf_logits(hf, other))


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.mark.slow  # transformers' generate; the quick tier keeps the logits and async = sync above and below
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_equals_transformers_generate(moe, async_scheduling):
    _, folder, hf = moe
    llm = LLM(folder, device="cpu", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8,
              async_scheduling=async_scheduling)
    prompts = [_prompt(5, 3), _prompt(23, 4), _prompt(70, 5)]  # 70 > 64: a chunked prefill
    for p, out in zip(prompts, llm.generate(prompts, GREEDY)):
        assert out.token_ids == hf_greedy(hf, p, 24)


@pytest.mark.quick_sample(1)  # the quick tier runs one family
def test_async_equals_sync_on_sampled_requests(moe):
    _, folder, _ = moe
    prompts = [_prompt(n, 10 + n) for n in (3, 9, 30, 50, 12)]
    params = [SamplingParams(max_tokens=12 + i, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    runs = []
    for async_scheduling in (False, True):
        llm = LLM(folder, device="cpu", max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4,
                  async_scheduling=async_scheduling)
        runs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert runs[0] == runs[1]


@pytest.mark.subprocess
def test_two_ranks_give_the_tokens_of_one(moe):
    _, folder, _ = moe
    prompts = [_prompt(6, 20), _prompt(40, 21)]
    params = [GREEDY, SamplingParams(max_tokens=10, temperature=0.9, seed=3, ignore_eos=True)]
    outs = []
    for tp in (1, 2):
        with LLM(folder, device="cpu", max_model_len=128, tensor_parallel_size=tp) as llm:
            outs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1]


def test_each_rank_loads_its_expert_slices(moe):
    _, folder, _ = moe
    for fmt in ("auto", "dummy"):
        whole, cfg = load_model(folder, fmt)
        for rank in range(2):
            shard = TPShard(rank, 2, cfg)
            part, _ = load_model(folder, fmt, tp=TPGroup(shard, None))
            i = shard.moe_intermediate_size
            cols = slice(rank * i, (rank + 1) * i)
            for w, p in zip(whole.layers, part.layers):
                gate, up = w.mlp.experts.gate_up_proj.chunk(2, dim=1)
                assert torch.equal(p.mlp.experts.gate_up_proj, torch.cat([gate[:, cols], up[:, cols]], dim=1))
                assert torch.equal(p.mlp.experts.down_proj, w.mlp.experts.down_proj[:, :, cols])
                assert torch.equal(p.mlp.gate.weight, w.mlp.gate.weight)  # the router: whole


def test_dummy_weights_from_a_config_json(moe, tmp_path):
    kind, folder, _ = moe
    model, config = load_model(f"{folder}/config.json", "dummy")
    assert config.num_experts == (8 if kind == "qwen3_moe" else 6)
    assert model.layers[0].mlp.experts.gate_up_proj.std().item() == pytest.approx(0.02, rel=0.1)
    llm = LLM(f"{folder}/config.json", load_format="dummy", device="cpu", max_model_len=64)
    assert len(llm.generate([[5, 6, 7]], GREEDY)[0].token_ids) == 24


def test_config_fields_and_refusals(moe):
    kind, folder, _ = moe
    with open(f"{folder}/config.json") as f:
        raw = json.load(f)
    cfg = ModelConfig.from_hf_config(raw)
    if kind == "mixtral":  # always renormalised; its intermediate_size is each expert's
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (6, 2, 32, True)
        return
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (8, 3, 32, False)
    assert cfg.qk_norm
    for bad in (dict(mlp_only_layers=[0]), dict(decoder_sparse_step=2)):
        with pytest.raises(ValueError, match="mlp_only_layers"):
            ModelConfig.from_hf_config({**raw, **bad})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf_config({**raw, "num_experts_per_tok": 9})


def test_floor_reads_only_the_experts_a_step_touches():
    from slipstream.bench.throughput import StepCosts, step_floors
    from slipstream.bench.workloads import get_workload
    from slipstream.core.tracing import BatchStats, Timeline
    from slipstream.model.loader import load_config

    w = get_workload("moe-30b-a3b")
    cfg = load_config(w.model)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.num_layers) == (128, 8, 768, 48)
    costs = StepCosts.of(cfg, torch.bfloat16)
    expert = 48 * 3 * 2048 * 768 * 2
    assert costs.expert_bytes == expert
    assert costs.experts_touched(1) == pytest.approx(8.0)
    assert costs.experts_touched(8) == pytest.approx(128 * (1 - (1 - 8 / 128) ** 8))
    assert costs.experts_touched(10_000) == pytest.approx(128.0)
    layer = 2048 * (4096 + 2 * 512) + 4096 * 2048 + 2048 * 128  # qkv, o and the router
    assert costs.weight_bytes == (48 * layer + 151936 * 2048) * 2  # + the LM head
    one = BatchStats(0, num_tokens=1, num_samples=1, context_tokens=0, attention_pairs=0.0)
    (floor,) = step_floors(Timeline(batches=[one]), cfg, torch.bfloat16, 1e12, 1e18)
    assert floor == pytest.approx((costs.weight_bytes + 8 * expert + costs.kv_bytes(one)) / 1e12)
    # per token: attention and the router, and k experts' products
    assert costs.matmul_params == 48 * (layer + 8 * 3 * 2048 * 768)
    for n in (1, 8, 64):
        latency = get_workload(f"moe-30b-a3b-bs{n}")
        assert latency.latency and latency.prompts == w.prompts[:n]
