"""The EAGLE-3 head: a tiny random checkpoint written in the published layouts (speculators'
and the EAGLE-3 authors'), loaded, and run over the engine's paged cache against a forward
written out by hand from the checkpoint's tensors."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from slipstream.model.eagle3 import Eagle3Config, default_aux_layers
from slipstream.model.eagle3_loader import load_eagle3
from slipstream.ops.metadata import AttentionMetadata

# head_dim 16: the Triton attention on the GPU takes powers of two >= 16 (tests/test_spec_gpu.py)
H, HT, I, NH, NKV, V, VD = 32, 24, 48, 2, 1, 50, 20
HD = H // NH
EPS, THETA = 1e-5, 10000.0
LAYER = {"hidden_size": H, "intermediate_size": I, "num_attention_heads": NH, "num_key_value_heads": NKV,
         "rms_norm_eps": EPS, "vocab_size": V, "max_position_embeddings": 64, "rope_theta": THETA,
         "hidden_act": "silu"}


def _checkpoint(g, speculators: bool) -> dict[str, torch.Tensor]:
    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.2
    layer = "layers.0." if speculators else "midlayer."
    sd = {"fc.weight": rnd(H, 3 * HT), "norm.weight": 1 + rnd(H), "lm_head.weight": rnd(VD, H),
          layer + "self_attn.q_proj.weight": rnd(NH * HD, 2 * H),
          layer + "self_attn.k_proj.weight": rnd(NKV * HD, 2 * H),
          layer + "self_attn.v_proj.weight": rnd(NKV * HD, 2 * H),
          layer + "self_attn.o_proj.weight": rnd(H, NH * HD),
          layer + "mlp.gate_proj.weight": rnd(I, H), layer + "mlp.up_proj.weight": rnd(I, H),
          layer + "mlp.down_proj.weight": rnd(H, I),
          layer + "input_layernorm.weight": 1 + rnd(H), layer + "hidden_norm.weight": 1 + rnd(H),
          layer + "post_attention_layernorm.weight": 1 + rnd(H)}
    targets = torch.randperm(V, generator=g)[:VD].sort().values
    sd["d2t"] = targets - torch.arange(VD)
    if speculators:  # speculators' heads carry fc's bias, their embedding and t2d
        sd["fc.bias"] = rnd(H)
        sd["embed_tokens.weight"] = rnd(V, H)
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[targets] = True
        sd["t2d"] = t2d
    return sd


def _write(folder, sd, speculators: bool, norm_before_residual=False):
    if speculators:
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "transformer_layer_config": {**LAYER, "model_type": "llama"}, "draft_vocab_size": VD,
               "norm_before_residual": norm_before_residual, "target_hidden_size": HT}
    else:
        cfg = {**LAYER, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": VD,
               "target_hidden_size": HT, "norm_before_residual": norm_before_residual}
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rope(x, pos):  # neox (rotate-half) RoPE over [T, heads, HD]
    inv = 1.0 / THETA ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1).float()[:, None], torch.cat([ang.sin()] * 2, -1).float()[:, None]
    x1, x2 = x[..., :HD // 2], x[..., HD // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _reference(sd, embed, ids, g_in, norm_before_residual):
    """The head's forward over one whole sequence, from the checkpoint's tensors alone."""
    p = {k.replace("midlayer.", "L.").replace("layers.0.", "L."): v for k, v in sd.items()}
    e = _rms(embed[ids], p["L.input_layernorm.weight"])
    hn = _rms(g_in, p["L.hidden_norm.weight"])
    residual = hn if norm_before_residual else g_in
    x = torch.cat([e, hn], -1)
    T = ids.shape[0]
    pos = torch.arange(T)
    q = _rope((x @ p["L.self_attn.q_proj.weight"].T).view(T, NH, HD), pos)
    k = _rope((x @ p["L.self_attn.k_proj.weight"].T).view(T, NKV, HD), pos)
    v = (x @ p["L.self_attn.v_proj.weight"].T).view(T, NKV, HD)
    k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HD)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, NH * HD)
    h = residual + attn @ p["L.self_attn.o_proj.weight"].T
    m = _rms(h, p["L.post_attention_layernorm.weight"])
    h = h + (torch.nn.functional.silu(m @ p["L.mlp.gate_proj.weight"].T) * (m @ p["L.mlp.up_proj.weight"].T)) \
        @ p["L.mlp.down_proj.weight"].T
    return _rms(h, p["norm.weight"]), h


def _meta(lengths, starts, block_size=4, width=8):
    """Two sequences: `starts` tokens already cached, `lengths` new ones; blocks in order."""
    q_loc, slots, positions, tables = [0], [], [], []
    for i, (n, s) in enumerate(zip(lengths, starts)):
        table = list(range(i * width, (i + 1) * width))
        for pos in range(s, s + n):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            positions.append(pos)
        q_loc.append(q_loc[-1] + n)
        tables.append(table)
    seq_lens = [s + n for n, s in zip(lengths, starts)]
    return AttentionMetadata(torch.tensor(q_loc, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                             torch.tensor(tables, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32),
                             max_query_len=max(lengths), max_seq_len=max(seq_lens)), torch.tensor(positions)


@pytest.mark.parametrize("speculators, norm_before_residual", [(True, False), (False, False), (True, True)])
def test_the_loaded_head_equals_the_forward_written_from_its_tensors(tmp_path, speculators, norm_before_residual):
    g = torch.Generator().manual_seed(3)
    sd = _checkpoint(g, speculators)
    _write(tmp_path, sd, speculators, norm_before_residual)
    head = load_eagle3(str(tmp_path), dtype="float32")
    target_embed = torch.randn(V, H, generator=g)
    if speculators:
        assert head.config.fc_bias and head.embed_tokens is not None
        embed = sd["embed_tokens.weight"]
    else:  # the authors' heads share the target's embedding
        assert not head.config.fc_bias and head.embed_tokens is None
        head.share_embedding(target_embed)
        embed = target_embed
    kv = (torch.zeros(16, 4, NKV, HD), torch.zeros(16, 4, NKV, HD))
    lens = [7, 5]
    ids = [torch.randint(0, V, (n + 1,), generator=g) for n in lens]
    aux = [torch.randn(n + 1, 3 * HT, generator=g) for n in lens]
    # the first step: every position's hidden state is fused from the target's three layers
    fused = head.combine_hidden_states(torch.cat([a[:n] for a, n in zip(aux, lens)]))
    want_fc = torch.cat([a[:n] for a, n in zip(aux, lens)]) @ sd["fc.weight"].T + sd.get("fc.bias", 0)
    torch.testing.assert_close(fused, want_fc)
    meta, pos = _meta(lens, [0, 0])
    normed, prenorm = head(torch.cat([t[:n] for t, n in zip(ids, lens)]), pos, fused, meta, kv)
    # then one more token a sequence, attending over the cache the first call filled
    extra = torch.randn(2, H, generator=g)  # e.g. the pre-norm output fed back
    meta2, pos2 = _meta([1, 1], lens)
    normed2, prenorm2 = head(torch.stack([t[n] for t, n in zip(ids, lens)]), pos2, extra, meta2, kv)
    offsets = [0, lens[0]]
    for i, n in enumerate(lens):
        g_in = torch.cat([want_fc[offsets[i]:offsets[i] + n], extra[i:i + 1]])
        ref_normed, ref_pre = _reference(sd, embed, ids[i], g_in, norm_before_residual)
        torch.testing.assert_close(normed[offsets[i]:offsets[i] + n], ref_normed[:n], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(prenorm[offsets[i]:offsets[i] + n], ref_pre[:n], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(normed2[i], ref_normed[n], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(prenorm2[i], ref_pre[n], rtol=1e-4, atol=1e-4)
    # logits over the draft vocabulary, and mapped into the target's through d2t
    logits = head.compute_logits(normed)
    assert logits.shape == (sum(lens), VD)
    torch.testing.assert_close(logits, normed @ sd["lm_head.weight"].T)
    targets = torch.arange(VD) + sd["d2t"]
    assert torch.equal(head.draft_to_target(torch.arange(VD)), targets)
    full = head.target_logits(normed)
    assert full.shape == (sum(lens), V)
    torch.testing.assert_close(full[:, targets], logits)
    others = torch.ones(V, dtype=torch.bool)
    others[targets] = False
    assert torch.isneginf(full[:, others]).all()
    assert torch.equal(head.t2d, ~others)


def test_random_weights_from_the_config_alone(tmp_path):
    _write(tmp_path, _checkpoint(torch.Generator().manual_seed(0), True), True)
    head = load_eagle3(str(tmp_path / "config.json"), load_format="dummy", dtype="float32", seed=5)
    targets = head.draft_to_target(torch.arange(VD))
    assert (targets.diff() > 0).all() and targets.min() >= 0 and targets.max() < V
    assert head.t2d.sum() == VD and head.t2d[targets].all()
    kv = (torch.zeros(16, 4, NKV, HD), torch.zeros(16, 4, NKV, HD))
    meta, pos = _meta([3, 2], [0, 0])
    normed, _ = head(torch.tensor([1, 2, 3, 4, 5]), pos, head.combine_hidden_states(torch.randn(5, 3 * HT)), meta, kv)
    assert torch.isfinite(head.compute_logits(normed)).all()
    again = load_eagle3(str(tmp_path / "config.json"), load_format="dummy", dtype="float32", seed=5)
    assert torch.equal(again.fc.weight, head.fc.weight)


def test_config_forms_and_aux_layers():
    a = Eagle3Config.from_hf_config({**LAYER, "draft_vocab_size": VD})
    b = Eagle3Config.from_hf_config({"transformer_layer_config": LAYER, "draft_vocab_size": VD,
                                     "target_hidden_size": HT, "eagle_aux_hidden_state_layer_ids": [1, 9, 20]})
    assert (a.hidden_size, a.target_hidden_size, a.vocab_size, a.draft_vocab_size) == (H, H, V, VD)
    assert b.target_hidden_size == HT and b.aux_layers(32) == (1, 9, 20)
    assert a.aux_layers(32) == default_aux_layers(32) == (2, 16, 29)
    with pytest.raises(ValueError, match="target has 16 layers"):
        b.aux_layers(16)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Config.from_hf_config({**LAYER, "draft_vocab_size": V + 1})
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        Eagle3Config.from_hf_config({"transformer_layer_config": LAYER, "speculators_model_type": "mlp"})
    with pytest.raises(ValueError, match="missing"):
        Eagle3Config.from_hf_config({"draft_vocab_size": VD, "hidden_size": H, "num_attention_heads": NH})


@pytest.mark.parametrize("change, words", [
    (lambda sd: sd.pop("d2t"), "missing EAGLE-3 tensors: \\['d2t'\\]"),
    (lambda sd: sd.pop("layers.0.self_attn.k_proj.weight"), "missing EAGLE-3 tensors: \\['layer.qkv_proj.weight'\\]"),
    (lambda sd: sd.update({"fc.weight": torch.zeros(H, 3 * H)}), "fc.weight has shape"),
    (lambda sd: sd.update({"layers.1.mlp.up_proj.weight": torch.zeros(I, H)}), "unexpected tensors"),
    (lambda sd: sd.update({"d2t": torch.full((VD,), V)}), "outside the target vocabulary"),
])
def test_bad_checkpoints_raise_naming_the_tensor(tmp_path, change, words):
    sd = _checkpoint(torch.Generator().manual_seed(1), True)
    change(sd)
    _write(tmp_path, sd, True)
    with pytest.raises(ValueError, match=words):
        load_eagle3(str(tmp_path), dtype="float32")


def test_the_targets_aux_hidden_states_are_the_residual_stream_entering_its_layers(tmp_path):
    """Captured from slipstream's target forward, they equal transformers' hidden_states[i]
    (the input of layer i) at the default layers of a 6-layer Llama."""
    import transformers

    from slipstream.model.eagle3 import AuxHiddenCapture
    from slipstream.model.loader import load_model

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    hf.save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), dtype="float32")
    ids = torch.randint(0, 64, (9,))
    with torch.no_grad():
        want = hf(ids[None], output_hidden_states=True).hidden_states
    layers = default_aux_layers(6)
    assert layers == (2, 3, 3)
    kv = [(torch.zeros(8, 4, 2, 8), torch.zeros(8, 4, 2, 8)) for _ in range(6)]
    meta, pos = _meta([9], [0], width=4)
    capture = AuxHiddenCapture(model, layers)
    with torch.no_grad(), capture:
        model(ids.to(torch.int32), pos, meta, kv)
    aux = capture.aux()
    assert aux.shape == (9, 3 * 32)
    for part, layer in zip(aux.split(32, dim=-1), layers):
        torch.testing.assert_close(part, want[layer][0], rtol=1e-4, atol=1e-4)
    assert not model.layers[2]._forward_pre_hooks  # the hooks go with the block
    with pytest.raises(ValueError, match="outside the target's 6 layers"):
        AuxHiddenCapture(model, (2, 3, 6))
