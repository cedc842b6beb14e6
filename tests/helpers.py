"""Shared test utilities: tiny random Hugging Face models, and a paged-KV greedy loop.

Import from tests as `from helpers import ...` (pytest puts tests/ on sys.path).

- `make_hf_model(kind, folder)` saves a tiny random HF model of one family (fp32, peaked
  logits) with `save_pretrained`; `TINY_MODELS` lists the kinds.
- `PagedModelRunner` drives `slipstream.model.llama.LlamaForCausalLM` directly over a paged
  KV cache, building `AttentionMetadata` and slot mappings by hand (random block ids).
- `smollm2()` loads the embedded GGUF model once per process (shared by test files).
"""
from __future__ import annotations

import contextlib
import functools
import os
import random
from dataclasses import dataclass

import numpy as np
import torch

from slipstream import LLM
from slipstream.ops.metadata import AttentionMetadata

# kind -> (transformers class names, config overrides, tied, save shard size)
_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               initializer_range=0.15, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
TINY_MODELS = {
    # untied, saved in shards (model.safetensors.index.json)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0), False, "100KB"),
    # Llama 3.1 rope scaling; original context 64 so every branch of the scaling is used
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               dict(rope_theta=500000.0, num_key_value_heads=1,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=64)),
               True, None),
    # a window shorter than most test prompts: every layer attends to its last 16 keys
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16), False, None),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0), True, None),
    # explicit head_dim different from hidden / heads
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_theta=1000000.0),
              False, None),
    # Gemma 3: a sliding layer (window 8, its own RoPE base) then a full one, an attention
    # scale of its own, softcapped logits
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=16, sliding_window=8, sliding_window_pattern=2, rope_theta=10000.0,
                    rope_local_base_freq=1000.0, query_pre_attn_scalar=24, final_logit_softcapping=30.0),
               True, None),
}


def make_hf_model(kind: str, folder: str, seed: int | None = None):
    """Save a tiny random fp32 HF model of family `kind` into `folder`; return the HF model."""
    import transformers

    config_cls, model_cls, overrides, tied, shard = TINY_MODELS[kind]
    kwargs = {**_COMMON, **overrides, "tie_word_embeddings": tied}
    rope_scaling = kwargs.pop("rope_scaling", None)
    config = getattr(transformers, config_cls)(**kwargs)
    if rope_scaling is not None:
        config.rope_parameters = {**rope_scaling, "rope_theta": kwargs["rope_theta"]}
    torch.manual_seed(list(TINY_MODELS).index(kind) if seed is None else seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():  # norms away from 1 so that their weights are exercised
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    save_kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **save_kwargs)
    model.generation_config.eos_token_id = None  # greedy runs go the full length
    model.generation_config.pad_token_id = 0
    return model


def make_tiny_chat_model(folder: str) -> str:
    """A tiny random Llama (2 layers, hidden 64) with the embedded SmolLM2's tokenizer and chat
    template, saved into `folder`: the real chat prompts' tokens at a fraction of SmolLM2's
    cost (no pilot run, unlike async_mix's tokenized model). Returns `folder`."""
    import transformers

    from slipstream.model.tokenizer import load_tokenizer
    tok = load_tokenizer(os.environ.get("SLIPSTREAM_TEST_TOKENIZER"))
    config = transformers.LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).float().save_pretrained(folder)
    tok.hf.save_pretrained(folder)
    return folder


def prompt(n: int, seed: int, vocab: int = 256) -> list[int]:
    """n random token ids of a tiny model's vocabulary (3 and up: past the special ids)."""
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def engine(folder, **kw) -> LLM:
    """An LLM on the CPU over a tiny model's folder, max_model_len 256 unless given."""
    kw.setdefault("device", "cpu")
    kw.setdefault("max_model_len", 256)
    return LLM(folder, **kw)


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logits(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].float()


def write_gguf(hf_model, path: str, qtype: str | None = None) -> None:
    """Write a tiny HF Llama/Qwen2/Qwen3/Gemma 3 model as an F32 GGUF the way llama.cpp's converter
    does: its tensor names (from the gguf package's own name map), q/k rows of the llama
    architecture permuted, Llama 3.1 rope scaling as a `rope_freqs` tensor, Gemma's norms
    as 1 + w.  qtype (e.g.
    "Q8_0"): every matrix whose rows are whole blocks of 32 stored in that type instead."""
    import gguf
    import numpy as np

    cfg = hf_model.config
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
            "qwen3": gguf.MODEL_ARCH.QWEN3, "gemma3_text": gguf.MODEL_ARCH.GEMMA3}[cfg.model_type]
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    name_map = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(path, arch_name)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    gemma = arch == gguf.MODEL_ARCH.GEMMA3
    rope = cfg.rope_parameters["full_attention"] if gemma else cfg.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    if gemma:  # llama.cpp's converter: the window, and each layer's sliding flag
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        if cfg.final_logit_softcapping is not None:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    if rope.get("rope_type") == "llama3":
        plain = 1.0 / cfg.rope_parameters["rope_theta"] ** (
            torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        scaled = hf_model.model.rotary_emb.inv_freq.double()
        writer.add_tensor("rope_freqs.weight", (plain / scaled).float().numpy())

    def permute(w, heads):
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.detach().float().numpy()
        if gemma and name.endswith("norm.weight"):  # stored as 1 + w
            w = w + 1.0
        if arch == gguf.MODEL_ARCH.LLAMA and ".q_proj." in name:
            w = permute(w, cfg.num_attention_heads)
        elif arch == gguf.MODEL_ARCH.LLAMA and ".k_proj." in name:
            w = permute(w, cfg.num_key_value_heads)
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name, name
        if qtype and w.ndim == 2 and w.shape[1] % 32 == 0:
            q = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(w), q), raw_dtype=q)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@dataclass
class _Seq:
    blocks: list[int]
    num_cached: int = 0


class PagedModelRunner:
    """Runs a LlamaForCausalLM over a paged KV cache, with metadata built by hand."""

    def __init__(self, model, num_blocks: int = 256, block_size: int = 4, seed: int = 0):
        cfg = model.config
        self.model, self.block_size = model, block_size
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=model.dtype, device=model.device),
                           torch.zeros(shape, dtype=model.dtype, device=model.device))
                          for _ in range(cfg.num_layers)]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # sequences get scattered, non-contiguous blocks
        self.seqs: dict[int, _Seq] = {}

    def step(self, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Feed `chunks` [(seq_id, new tokens)] as one batch; float32 logits for every token."""
        input_ids, positions, slots, q_loc, seq_lens, tables = [], [], [], [0], [], []
        for seq_id, tokens in chunks:
            seq = self.seqs.setdefault(seq_id, _Seq([]))
            total = seq.num_cached + len(tokens)
            while len(seq.blocks) * self.block_size < total:
                seq.blocks.append(self.free.pop())
            for pos in range(seq.num_cached, total):
                positions.append(pos)
                slots.append(seq.blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            input_ids += tokens
            q_loc.append(q_loc[-1] + len(tokens))
            seq_lens.append(total)
            tables.append(seq.blocks)
            seq.num_cached = total
        width = max(len(t) for t in tables)
        table = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        dev = self.model.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(q_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=table.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int32, device=dev),
            max_query_len=max(len(t) for _, t in chunks),
            max_seq_len=max(seq_lens))
        with torch.no_grad():
            hidden = self.model(torch.tensor(input_ids, dtype=torch.int32, device=dev),
                                torch.tensor(positions, dtype=torch.int32, device=dev), meta,
                                self.kv_caches)
            return self.model.compute_logits(hidden)

    @staticmethod
    def last_rows(logits: torch.Tensor, chunks) -> torch.Tensor:
        ends = torch.tensor([len(t) for _, t in chunks]).cumsum(0) - 1
        return logits[ends]


@functools.lru_cache(maxsize=None)
def smollm2():
    """(model, config, tokenizer) of the embedded SmolLM2 GGUF, float32 on CPU, loaded once."""
    from slipstream.model.loader import load_model
    from slipstream.model.tokenizer import load_tokenizer

    model, config = load_model(None)
    return model, config, load_tokenizer(None)


@contextlib.contextmanager
def gguf_loads_once():
    """transformers' GGUF load with two of its repeated costs paid once, its results unchanged:
    it builds gguf's tensor-name map again for each module of the model (397 for SmolLM2, a
    third of the load) and parses the whole file twice, for the config and then the weights
    (the tokenizer's 49,152 strings each time). The same gguf functions run; within this block
    their results are reused. The reader reads the file into memory, the same bytes as its
    np.memmap: it parses the header with a million small slices, and a memmap's slice is a
    Python-level subclass call (Gemma 3's 262,144 tokenizer strings: ~10 s of the load)."""
    import types

    import gguf
    import gguf.gguf_reader as gguf_reader

    name_map, reader, reader_np = gguf.get_tensor_name_map, gguf.GGUFReader, gguf_reader.np
    readers: dict = {}

    def read_once(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader(path, *args, **kwargs)
        return readers[key]

    def in_memory(path, mode="r"):
        assert mode == "r", mode  # (a read-only load; the file is never written through it)
        return np.fromfile(path, dtype=np.uint8)

    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    gguf.GGUFReader = read_once
    gguf_reader.np = types.SimpleNamespace(**{**vars(np), "memmap": in_memory})
    try:
        yield
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader, gguf_reader.np = name_map, reader, reader_np


def hf_from_gguf(path: str):
    """A transformers model (float32, eval) loaded from GGUF file `path` by transformers."""
    from transformers import AutoModelForCausalLM

    with gguf_loads_once():
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)
def smollm2_hf():
    """The transformers oracle: HF loads the same GGUF file (slow: ~10 s)."""
    from slipstream.model.loader import embedded_model_path

    return hf_from_gguf(embedded_model_path())


def drain_core(core) -> tuple[dict[str, tuple[str, str | None]], dict[str, list[int]]]:
    """Steps an EngineCore until it has no work; returns each request's (finish_reason,
    error) and the tokens it got."""
    ends: dict[str, tuple[str, str | None]] = {}
    tokens: dict[str, list[int]] = {}
    while core.has_work():
        for o in core.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                ends[o.request_id] = (o.finish_reason, o.error)
    return ends, tokens


def rel_rms(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMS error of y against ref, in float64."""
    y, ref = y.double(), ref.double()
    return ((y - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()


def run_hopper_compile(test_file: str, timeout: float = 600) -> str:
    """Run `test_file --compile-for-hopper` in a subprocess without TRITON_INTERPRET (its
    kernels compiled for sm_90 on a machine with no GPU) and return what it printed; a failed
    run fails the calling test with its output."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tests = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, tests, env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, os.path.abspath(test_file), "--compile-for-hopper"], env=env, cwd=root,
                       capture_output=True, text=True, timeout=timeout, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r.stdout


def compile_pdl_launches_for_hopper(launches) -> None:
    """Compile each recorded Triton launch (`test_attention_kernels.recorded_launches`) for
    sm_90 as the launcher would (`test_attention_kernels.compile_launch_for_hopper`, PDL on);
    check each waits on the grid dependency and print "compiled <kernel>" (what
    `run_hopper_compile`'s callers read)."""
    from test_attention_kernels import compile_launch_for_hopper
    for fn, args, kw in launches:
        compiled, _, _ = compile_launch_for_hopper(fn, args, kw)
        assert "griddepcontrol.wait" in compiled.asm["ptx"]
        print("compiled", fn.__name__)


class StandInGraph:
    """A captured step on the CPU: its replay runs the closure the capture recorded."""

    def __init__(self, work) -> None:
        self.work = work

    def replay(self) -> None:
        self.work()


class StandInSteps:
    """What VerifyGraphs needs of the step graphs, on the CPU: a pool, capture, no cloner;
    `captures` counts the graphs captured."""

    def __init__(self) -> None:
        self.pool, self.cloner, self.capture_s, self.captures = object(), None, 0.0, 0

    def capture_work(self, runner, work, keep: bool = False) -> StandInGraph:
        self.captures += 1
        return StandInGraph(work)
