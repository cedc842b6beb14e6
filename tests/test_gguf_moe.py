"""GGUF files of mixture-of-experts models (model/gguf_moe.py) against the safetensors load of
the same tiny random Qwen3-MoE and Mixtral weights.

The files are written as llama.cpp's converter writes them: arch `qwen3moe`, or `llama` with
`expert_count` for Mixtral (its q/k rows permuted), each layer's experts stacked into
`ffn_{gate,up,down}_exps` [E, rows, cols] and the router as `ffn_gate_inp`; or, as older
Mixtral files, one `ffn_gate.{e}` tensor an expert.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import PagedModelRunner, hf_greedy
from test_moe_model import MOE_MODELS, make_moe_model

from slipstream.model.gguf import GGUFFile
from slipstream.model.loader import load_model
from slipstream.model.parallel import TPGroup, TPShard

# kind -> (GGUF architecture, HF names of (block, gate, up, down))
_LAYOUT = {"qwen3_moe": ("qwen3moe", ("mlp", "gate_proj", "up_proj", "down_proj")),
           "mixtral": ("llama", ("block_sparse_moe", "w1", "w3", "w2"))}
_DENSE = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for the `llama` architecture."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_moe_gguf(kind: str, folder: str, path: str, qtype: str | None = None,
                   stacked: bool = True, extra_tensors: dict | None = None) -> None:
    """The safetensors weights of `folder` as a llama.cpp MoE GGUF (F32, or `qtype` for every
    matrix); `stacked` False: one tensor an expert (older Mixtral files)."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    arch, (block, *projs) = _LAYOUT[kind]
    state = {k: v.float().numpy() for k, v in load_file(f"{folder}/model.safetensors").items()}
    experts = cfg.num_experts if kind == "qwen3_moe" else cfg.num_local_experts
    inter = cfg.moe_intermediate_size if kind == "qwen3_moe" else cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if kind == "qwen3_moe":
        w.add_expert_feed_forward_length(inter)
        w.add_expert_weights_norm(bool(cfg.norm_topk_prob))  # llama.cpp renormalises without it

    def add(name: str, t: np.ndarray) -> None:
        t = np.ascontiguousarray(t)
        if qtype and t.ndim >= 2 and t.shape[-1] % 32 == 0:
            q = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(t, q), raw_dtype=q)
        else:
            w.add_tensor(name, t)

    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    add("output.weight", state["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}"
        for hf, name in _DENSE.items():
            if f"{pre}.{hf}.weight" not in state:
                continue
            t = state[f"{pre}.{hf}.weight"]
            if arch == "llama" and hf in ("self_attn.q_proj", "self_attn.k_proj"):
                t = _permute(t, cfg.num_attention_heads if "q_proj" in hf else cfg.num_key_value_heads)
            add(f"blk.{i}.{name}.weight", t)
        add(f"blk.{i}.ffn_gate_inp.weight", state[f"{pre}.{block}.gate.weight"])
        for proj, name in zip(projs, ("ffn_gate", "ffn_up", "ffn_down")):
            per_expert = [state[f"{pre}.{block}.experts.{e}.{proj}.weight"] for e in range(experts)]
            if stacked:
                add(f"blk.{i}.{name}_exps.weight", np.stack(per_expert))
            else:
                for e, t in enumerate(per_expert):
                    add(f"blk.{i}.{name}.{e}.weight", t)
    for name, t in (extra_tensors or {}).items():
        add(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=list(MOE_MODELS))
def moe_files(request, tmp_path_factory):
    """(kind, safetensors folder, stacked F32 GGUF path, their tmp dir, the HF model)."""
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    folder = str(root / "hf")
    hf = make_moe_model(request.param, folder)
    path = str(root / "model.gguf")
    write_moe_gguf(request.param, folder, path)
    return request.param, folder, path, root, hf


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_config_from_gguf_metadata(moe_files):
    _, folder, path, _, _ = moe_files
    from_gguf, from_hf = load_model(path)[1], load_model(folder)[1]
    for field in ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "norm_topk_prob", "qk_norm", "num_heads", "num_kv_heads", "head_dim"):
        assert getattr(from_gguf, field) == getattr(from_hf, field), field


def test_logits_equal_the_safetensors_load(moe_files):
    _, folder, path, _, _ = moe_files
    prompt, other = _prompt(33, 1), _prompt(9, 2)
    logits = []
    for source in (folder, path):
        runner = PagedModelRunner(load_model(source)[0])
        logits.append(torch.cat([runner.step([(0, prompt[:20])]),
                                 runner.step([(0, prompt[20:]), (1, other)])]))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_greedy_tokens_of_the_gguf_load_equal_transformers(moe_files):
    _, _, path, _, hf = moe_files
    prompt = _prompt(33, 1)
    runner, tokens = PagedModelRunner(load_model(path)[0]), []
    last = runner.step([(0, prompt)])[-1]
    for _ in range(12):  # greedy decode of the GGUF load, one token a step
        tokens.append(int(last.argmax()))
        last = runner.step([(0, tokens[-1:])])[-1]
    assert tokens == hf_greedy(hf, prompt, 12)


def test_each_rank_loads_its_expert_slices_from_gguf(moe_files):
    """Under tensor parallelism a rank reads each expert's intermediate slice of the stacked
    tensors (F32 and Q8_0 files), equal to its slice of the one-rank load."""
    kind, folder, path, root, _ = moe_files
    q8 = str(root / "model-q8.gguf")
    write_moe_gguf(kind, folder, q8, qtype="Q8_0")
    for source in (path, q8):
        whole, cfg = load_model(source)
        for rank in range(2):
            shard = TPShard(rank, 2, cfg)
            part, _ = load_model(source, tp=TPGroup(shard, None))
            i = shard.moe_intermediate_size
            cols = slice(rank * i, (rank + 1) * i)
            for w, p in zip(whole.layers, part.layers):
                gate, up = w.mlp.experts.gate_up_proj.chunk(2, dim=1)
                assert torch.equal(p.mlp.experts.gate_up_proj, torch.cat([gate[:, cols], up[:, cols]], dim=1))
                assert torch.equal(p.mlp.experts.down_proj, w.mlp.experts.down_proj[:, :, cols])
                assert torch.equal(p.mlp.gate.weight, w.mlp.gate.weight)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_one_expert_dequantized_equals_the_gguf_package(moe_files, qtype):
    kind, folder, _, root, _ = moe_files
    path = str(root / f"model-{qtype}.gguf")
    write_moe_gguf(kind, folder, path, qtype=qtype)
    f = GGUFFile(path)
    for name in ("blk.1.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight"):
        whole = f.read_reference(name)
        for e in range(whole.shape[0]):
            assert torch.equal(f.read_expert(name, e), whole[e])


def test_per_expert_tensors_of_older_mixtral_files(tmp_path):
    folder, path, old = str(tmp_path / "hf"), str(tmp_path / "stacked.gguf"), str(tmp_path / "old.gguf")
    make_moe_model("mixtral", folder)
    write_moe_gguf("mixtral", folder, path)
    write_moe_gguf("mixtral", folder, old, stacked=False)
    a, b = load_model(path)[0], load_model(old)[0]
    for x, y in zip(a.layers, b.layers):
        assert torch.equal(x.mlp.experts.gate_up_proj, y.mlp.experts.gate_up_proj)
        assert torch.equal(x.mlp.experts.down_proj, y.mlp.experts.down_proj)


def test_shared_experts_are_refused_by_name(moe_files):
    kind, folder, _, root, _ = moe_files
    path = str(root / "model-shexp.gguf")
    write_moe_gguf(kind, folder, path,
                   extra_tensors={"blk.0.ffn_up_shexp.weight": np.zeros((32, 64), np.float32)})
    with pytest.raises(ValueError, match="shared experts.*ffn_up_shexp"):
        load_model(path)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_one_expert_of_a_k_quant_tensor_is_its_own_byte_range(tmp_path, qtype):
    """K-quant experts (256-value blocks, dequantized by the gguf package) read one at a time
    equal the whole stacked tensor's slices (random blocks with sane fp16 scales)."""
    import gguf

    q = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[q]
    experts, rows, cols = 3, 4, 2 * block
    raw = np.random.default_rng(0).integers(0, 256, (experts * rows * cols // block, size), dtype=np.uint8)
    scale_at = 0 if qtype == "Q4_K" else size - 2  # Q4_K: d and dmin first; Q6_K: d last
    raw[:, scale_at:scale_at + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if qtype == "Q4_K":
        raw[:, 2:4] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    path = str(tmp_path / "k.gguf")
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_tensor("blk.0.ffn_up_exps.weight", raw.reshape(experts, rows, cols // block * size), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    whole = f.read_reference("blk.0.ffn_up_exps.weight")
    assert whole.shape == (experts, rows, cols) and torch.isfinite(whole).all()
    for e in range(experts):
        assert torch.equal(f.read_expert("blk.0.ffn_up_exps.weight", e), whole[e])
    assert not torch.equal(whole[0], whole[1])
