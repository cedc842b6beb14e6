"""GGUF files (llama.cpp's format): metadata -> ModelConfig, tensors -> dequantized HF tensors.

The header is parsed here directly (it is a simple little-endian layout) because
`gguf.GGUFReader` builds a numpy view per vocabulary string, which costs seconds on a 49k-token
vocabulary; we skip the string arrays we do not need.  The `gguf` package still provides the
type tables and the dequantization of every type but the plain block formats, which
model/gguf_dequant.py dequantizes in torch (bit for bit the same, 2.4-3.5x faster on 2 CPU
cores, and a tensor-parallel rank's slice only).

llama.cpp's converter permutes the rows of q/k projections of the `llama` architecture so that
its RoPE can rotate interleaved pairs; we undo that to get the Hugging Face (rotate-half) layout.
For `gemma3` it stores every norm weight as 1 + w (ggml multiplies by the weight itself): we
give back w, as transformers does; the metadata lacks Gemma's local RoPE base and attention
scale, which take llama.cpp's values (10000; head_dim, or hidden / heads for the 62-layer 27B).
Mixture-of-experts files (`qwen3moe`, Mixtral as `llama` with experts): model/gguf_moe.py.
"""
from __future__ import annotations

import mmap
import os
import struct
from typing import Any, Iterator

import numpy as np
import torch

from slipstream.model import gguf_dequant, gguf_moe
from slipstream.model.config import ModelConfig
from slipstream.model.shards import Slice

# GGUF general.architecture -> (HF architecture, q/k rows permuted by llama.cpp)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", False),  # and llama with experts: Mixtral (gguf_moe.py)
    "gemma3": ("Gemma3ForCausalLM", False),
}

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Gemma 3 names its four norms of a layer differently (ffn_norm is the pre-MLP norm)
_GEMMA3_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                       "post_attention_norm": "post_attention_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm"}

# GGUF metadata value types (the GGUF spec numbers them 0..12)
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_ARRAY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                 6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# metadata string arrays worth decoding (the vocabulary and merges are left as their length)
_WANTED_STRING_ARRAYS = ("general.languages", "general.tags")


class GGUFTensorInfo:
    __slots__ = ("name", "shape", "qtype", "offset", "nbytes")

    def __init__(self, name, shape, qtype, offset, nbytes):
        self.name, self.shape, self.qtype, self.offset, self.nbytes = name, shape, qtype, offset, nbytes


class GGUFFile:
    """A GGUF file opened read-only: `metadata` (dict), `tensors` (name -> GGUFTensorInfo)."""

    def __init__(self, path: str | os.PathLike):
        import gguf  # the type tables and dequantization

        self.path = str(path)
        self._gguf = gguf
        with open(self.path, "rb") as f:
            try:
                self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # empty file
                raise ValueError(f"{self.path}: empty file, not a GGUF model") from None
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, OverflowError) as e:
            raise ValueError(f"{self.path}: corrupt or truncated GGUF file ({e})") from None

    # --- header parsing -------------------------------------------------------------------
    def _unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value[0] if len(value) == 1 else value

    def _string(self) -> str:
        n = self._unpack("<Q")
        s = self._buf[self._pos:self._pos + n]
        if len(s) != n:
            raise struct.error("string runs past the end of the file")
        self._pos += n
        return s.decode("utf-8")

    def _skip_string(self) -> None:
        self._pos += 8 + struct.unpack_from("<Q", self._buf, self._pos)[0]

    def _value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self._unpack(_SCALAR_FORMATS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise struct.error(f"unknown metadata value type {vtype} for {key!r}")
        etype, count = self._unpack("<IQ")
        if etype in _ARRAY_DTYPES:
            dt = np.dtype(_ARRAY_DTYPES[etype])
            arr = np.frombuffer(self._buf, dtype=dt, count=count, offset=self._pos).copy()
            self._pos += dt.itemsize * count
            return arr.tolist()
        if etype == _STRING:
            if key in _WANTED_STRING_ARRAYS:
                return [self._string() for _ in range(count)]
            for _ in range(count):
                self._skip_string()
            return _ArrayLength(count)
        raise struct.error(f"unsupported array element type {etype} for {key!r}")

    def _parse(self) -> None:
        if self._buf[:4] != b"GGUF":
            raise ValueError(f"{self.path}: not a GGUF file (bad magic bytes)")
        self._pos = 4
        version, n_tensors, n_kv = self._unpack("<IQQ")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are)")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"), key)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._unpack("<I")
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, self._pos)
            self._pos += 8 * n_dims
            qtype, offset = self._unpack("<IQ")
            infos.append((name, tuple(reversed(dims)), qtype, offset))  # ggml lists dims fastest first
        align = int(self.metadata.get("general.alignment", 32))
        data_start = (self._pos + align - 1) // align * align
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, qtype, offset in infos:
            qtype = self._gguf.GGMLQuantizationType(qtype)
            block, type_size = self._gguf.GGML_QUANT_SIZES[qtype]
            numel = int(np.prod(shape)) if shape else 1
            nbytes = numel // block * type_size
            if data_start + offset + nbytes > len(self._buf):
                raise ValueError(f"{self.path}: truncated GGUF file (tensor {name!r} runs past the end)")
            self.tensors[name] = GGUFTensorInfo(name, shape, qtype, data_start + offset, nbytes)

    # --- tensors --------------------------------------------------------------------------
    def read(self, name: str, s: Slice | None = None) -> torch.Tensor:
        """Tensor `name` dequantized to float32, in the (torch-order) shape of the file, or
        only slice `s` of it.  Q4_0 / Q4_1 / Q8_0 are dequantized here (model/gguf_dequant.py),
        of a slice only where it is whole rows or whole blocks of columns; other types by
        `gguf.quants.dequantize`, whole, then narrowed."""
        return self._read_info(self.tensors[name], s)

    def read_expert(self, name: str, expert: int, s: Slice | None = None) -> torch.Tensor:
        """Expert `expert`'s matrix of the stacked [E, rows, cols] tensor `name` (llama.cpp's
        `ffn_*_exps`), or slice `s` of it: only that expert's bytes are dequantized (its rows
        are whole blocks, so its bytes are one contiguous range of the tensor's)."""
        info = self.tensors[name]
        per_expert = info.nbytes // info.shape[0]
        part = GGUFTensorInfo(name, tuple(info.shape[1:]), info.qtype,
                              info.offset + expert * per_expert, per_expert)
        return self._read_info(part, s)

    def _read_info(self, info: GGUFTensorInfo, s: Slice | None) -> torch.Tensor:
        if gguf_dequant.supported(info.qtype.name) and len(info.shape) == 2:
            raw = np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
            rows = cols = None
            if s is not None and s.dim == 0:
                rows = (s.start, s.length)
            elif s is not None and s.start % gguf_dequant.BLOCK == 0 and s.length % gguf_dequant.BLOCK == 0:
                cols = (s.start, s.length)
            t = gguf_dequant.dequantize(raw, info.qtype.name, info.shape, rows=rows, cols=cols)
            return t if s is None or rows or cols else t.narrow(s.dim, s.start, s.length)
        t = self._reference(info)
        return t if s is None else t.narrow(s.dim, s.start, s.length)

    def read_reference(self, name: str) -> torch.Tensor:
        """Tensor `name` dequantized whole by `gguf.quants.dequantize` (any type): what `read`
        does for the types model/gguf_dequant.py lacks, and its oracle (tests, benchmarks)."""
        return self._reference(self.tensors[name])

    def _reference(self, info: GGUFTensorInfo) -> torch.Tensor:
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        block, type_size = self._gguf.GGML_QUANT_SIZES[info.qtype]
        cols = info.shape[-1] if info.shape else 1
        raw = raw.reshape(-1, cols // block * type_size)
        out = np.asarray(self._gguf.quants.dequantize(raw, info.qtype), dtype=np.float32)
        if not out.flags.writeable:  # float32 tensors come back as views of the mapped file
            out = out.copy()
        return torch.from_numpy(out.reshape(info.shape))

    def config(self) -> ModelConfig:
        return config_from_gguf_metadata(self.metadata, self.tensors, self)

    def iter_hf_tensors(self, config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...], Any]]:
        """(HF name, HF shape, loader) for every tensor; loader(slice) returns a float32 torch
        tensor, narrowed to a tensor-parallel rank's slice (model/shards.py) when given one.

        Unknown GGUF names come out as "gguf:<name>" so that the loader reports them.
        """
        arch = self.metadata.get("general.architecture")
        permuted = GGUF_ARCHITECTURES.get(arch, (None, False))[1]
        for name, info in self.tensors.items():
            if name == "rope_freqs.weight":  # folded into config.rope_scaling
                continue
            experts = gguf_moe.expert_hf_names(name, config) if config.is_moe else None
            if experts is not None:  # the router, or one item an expert of a stacked tensor
                for hf_name, e in experts:
                    if e is None:
                        yield hf_name, info.shape, lambda s=None, name=name: self.read(name, s)
                    else:
                        yield (hf_name, info.shape[1:],
                               lambda s=None, name=name, e=e: self.read_expert(name, e, s))
                continue
            hf_name = gguf_to_hf_name(name, arch)
            if hf_name is None:
                yield f"gguf:{name}", info.shape, lambda s=None, name=name: self.read(name, s)
                continue
            if arch == "gemma3" and name.endswith("norm.weight"):  # stored as 1 + w
                yield hf_name, info.shape, lambda s=None, name=name: self.read(name, s) - 1.0
                continue
            heads = None
            if permuted and ".self_attn.q_proj." in hf_name:
                heads = config.num_heads
            elif permuted and ".self_attn.k_proj." in hf_name:
                heads = config.num_kv_heads

            def load(s=None, name=name, heads=heads, rows=info.shape[0] if info.shape else 1):
                if not heads:
                    return self.read(name, s)
                head_dim = rows // heads
                if s is not None and s.dim == 0 and s.start % head_dim == 0 and s.length % head_dim == 0:
                    # whole heads (tensor parallelism): llama.cpp's row order is within a head
                    return unpermute_qk(self.read(name, s), s.length // head_dim)
                t = unpermute_qk(self.read(name), heads)
                return t if s is None else t.narrow(s.dim, s.start, s.length)

            yield hf_name, info.shape, load


class _ArrayLength(int):
    """Stands for a metadata string array that was skipped: its length only."""


def gguf_to_hf_name(name: str, arch: str | None = None) -> str | None:
    if name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[name]
    layer_names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    return None


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head, rows (2j, 2j+1) go back to (j, j + d/2)."""
    rows = w.shape[0]
    head_dim = rows // num_heads
    rest = w.shape[1:]
    return w.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


_FILE_TYPE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def config_from_gguf_metadata(md: dict[str, Any], tensor_names, gguf_file: GGUFFile | None = None
                              ) -> ModelConfig:
    arch = md.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)}")
    missing = object()

    def get(key, default=missing):
        value = md.get(f"{arch}.{key}", default)
        if value is missing:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    heads = get("attention.head_count")
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts: only a uniform one is supported
        if len(set(kv_heads)) != 1:
            raise ValueError(f"GGUF: per-layer head_count_kv {kv_heads} is not supported")
        kv_heads = kv_heads[0]
    hidden = get("embedding_length")
    head_dim = get("attention.key_length", hidden // heads)
    rope_dim = get("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"GGUF: partial rotary embedding (rope dim {rope_dim} != head_dim "
                         f"{head_dim}) is not supported")
    vocab = get("vocab_size", None) or md.get("tokenizer.ggml.tokens")
    if vocab is None and "token_embd.weight" in tensor_names and gguf_file is not None:
        vocab = gguf_file.tensors["token_embd.weight"].shape[0]

    scaling = None
    kind = get("rope.scaling.type", "none")
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif kind not in ("none", None):
        raise ValueError(f"unsupported rope scaling type {kind!r} in GGUF; supported: 'linear', "
                         "'llama3' (as rope_freqs)")
    if "rope_freqs.weight" in tensor_names and gguf_file is not None:
        factors = gguf_file.read("rope_freqs.weight").reshape(-1).tolist()
        scaling = {"rope_type": "freq_factors", "factors": factors}

    eos = [md[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                           "tokenizer.ggml.eom_token_id") if k in md]
    eos = list(dict.fromkeys(eos))
    window = get("attention.sliding_window", None)
    moe = gguf_moe.moe_fields(arch, get, tensor_names)
    return ModelConfig(
        architecture=moe.pop("architecture", GGUF_ARCHITECTURES[arch][0]),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=get("context_length", 4096),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        dtype=_FILE_TYPE_DTYPES.get(md.get("general.file_type")),
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=(eos[0] if len(eos) == 1 else eos) if eos else None,
        sliding_window=int(window) if window else None,
        **moe,
        **(_gemma3_fields(get, hidden, heads, head_dim) if arch == "gemma3" else {}),
    ).validate()


def _gemma3_fields(get, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """Gemma 3's fields beyond the common keys, with llama.cpp's values where the file has none."""
    layers = get("block_count")
    pattern = get("attention.sliding_window_pattern", 6)  # every n-th layer full, or a flag a layer
    sliding = list(pattern) if isinstance(pattern, list) else [(i + 1) % pattern != 0 for i in range(layers)]
    return dict(
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        rope_local_theta=10_000.0,
        query_pre_attn_scalar=float(hidden // heads if layers == 62 else head_dim),
        attn_logit_softcapping=get("attn_logit_softcapping", None),
        final_logit_softcapping=get("final_logit_softcapping", None))
