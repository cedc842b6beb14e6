"""Loading an EAGLE-3 head (model/eagle3.py): a folder with config.json and safetensors weights
in the published layout, or random weights from the config alone (`load_format="dummy"`).

Checkpoint names: the decoder layer is `midlayer.*` (the EAGLE-3 authors) or `layers.0.*`
(`speculators`), an optional leading `model.` is dropped; q/k/v and gate/up are merged into
one weight each, as in the target. `fc.bias` and `embed_tokens.weight` are optional (the
published heads differ); without an embedding the head shares the target's. Every problem is
a ValueError / FileNotFoundError naming the file or tensor."""
from __future__ import annotations

import dataclasses
import json
import os

import torch

from slipstream.model.eagle3 import Eagle3Config, Eagle3Head
from slipstream.model.loader import resolve_dtype
from slipstream.model.safetensors_files import safetensors_files

_LAYER_PREFIXES = ("midlayer.", "layers.0.")
# checkpoint name inside the layer -> (parameter, which part of it: None = whole, or the index
# of the part among the merged ones)
_LAYER_PARTS = {
    "self_attn.q_proj": ("qkv_proj", 0), "self_attn.k_proj": ("qkv_proj", 1),
    "self_attn.v_proj": ("qkv_proj", 2), "self_attn.o_proj": ("o_proj", None),
    "mlp.gate_proj": ("gate_up_proj", 0), "mlp.up_proj": ("gate_up_proj", 1),
    "mlp.down_proj": ("down_proj", None),
    "input_layernorm": ("input_layernorm", None), "hidden_norm": ("hidden_norm", None),
    "post_attention_layernorm": ("post_attention_layernorm", None),
}


def load_eagle3_config(source: str) -> Eagle3Config:
    path = source if source.endswith(".json") else os.path.join(source, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{source} has no config.json: not an EAGLE-3 head folder")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a valid JSON file ({e})") from None
    try:
        return Eagle3Config.from_hf_config(cfg)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def load_eagle3(source: str, load_format: str = "auto", dtype="auto", device="cpu",
                seed: int = 0) -> Eagle3Head:
    """An EAGLE-3 head from a folder (safetensors) or its config with random weights."""
    config = load_eagle3_config(source)
    dtype = resolve_dtype(dtype, config.layer, device)
    if load_format == "dummy":
        head = Eagle3Head(config, dtype, device)
        init_random_eagle3(head, seed)
        return head
    if load_format not in ("auto", "safetensors"):
        raise ValueError(f"an EAGLE-3 head loads from safetensors or dummy weights, not {load_format!r}")
    from safetensors import SafetensorError, safe_open
    state: dict[str, torch.Tensor] = {}
    for path in safetensors_files(source):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    state[name] = f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path}: corrupt or truncated safetensors file ({e})") from None
    names = {_canonical(name) for name in state}
    config = dataclasses.replace(config, fc_bias="fc.bias" in names)
    head = Eagle3Head(config, dtype, device, own_embedding="embed_tokens.weight" in names)
    load_eagle3_weights(head, state, where=source)
    return head


def _canonical(name: str) -> str:
    name = name.removeprefix("model.")
    for prefix in _LAYER_PREFIXES:
        if name.startswith(prefix):
            return "layer." + name[len(prefix):]
    return name


def _target(head: Eagle3Head, name: str) -> tuple[torch.Tensor, slice | None]:
    """The tensor a canonical checkpoint name fills, and the rows of it (merged weights)."""
    if name in ("d2t", "t2d"):
        return getattr(head, name), None
    if name.startswith("layer."):
        stem, _, kind = name[len("layer."):].rpartition(".")
        if stem not in _LAYER_PARTS or kind not in ("weight", "bias"):
            raise KeyError(name)
        pname, part = _LAYER_PARTS[stem]
        param = getattr(getattr(head.layer, pname), kind)
        if param is None:
            raise KeyError(name)
        if part is None:
            return param, None
        layer = head.layer
        sizes = ((layer.q_size, layer.kv_size, layer.kv_size) if pname == "qkv_proj"
                 else (param.shape[0] // 2,) * 2)
        start = sum(sizes[:part])
        return param, slice(start, start + sizes[part])
    module, _, kind = name.rpartition(".")
    if module not in ("fc", "norm", "lm_head", "embed_tokens") or kind not in ("weight", "bias"):
        raise KeyError(name)
    param = getattr(getattr(head, module), kind, None)
    if param is None:
        raise KeyError(name)
    return param, None


@torch.no_grad()
def load_eagle3_weights(head: Eagle3Head, state: dict[str, torch.Tensor], where: str = "checkpoint") -> None:
    """Copy a checkpoint's tensors (names as published) into `head`; every parameter and d2t
    must be filled, t2d is derived from d2t when absent."""
    filled: dict[int, int] = {}  # id(tensor) -> rows filled
    unknown = []
    for raw, value in state.items():
        name = _canonical(raw)
        try:
            dest, rows = _target(head, name)
        except KeyError:
            unknown.append(raw)
            continue
        view = dest if rows is None else dest[rows]
        if tuple(value.shape) != tuple(view.shape):
            raise ValueError(f"{where}: tensor {raw} has shape {tuple(value.shape)}, the head "
                             f"expects {tuple(view.shape)}")
        view.copy_(value.to(view.dtype))
        filled[id(dest)] = filled.get(id(dest), 0) + view.shape[0]
    if unknown:
        raise ValueError(f"{where}: unexpected tensors for an EAGLE-3 head: {sorted(unknown)[:8]}")
    missing = [name for name, t in _expected(head).items()
               if filled.get(id(t), 0) != t.shape[0]]
    if missing:
        raise ValueError(f"{where}: missing EAGLE-3 tensors: {missing}")
    targets = torch.arange(head.config.draft_vocab_size, device=head.d2t.device) + head.d2t
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= head.config.vocab_size):
        raise ValueError(f"{where}: d2t maps draft ids outside the target vocabulary "
                         f"(0..{head.config.vocab_size - 1})")
    if id(head.t2d) not in filled:
        head.t2d.zero_()[targets] = True


def _expected(head: Eagle3Head) -> dict[str, torch.Tensor]:
    names = {name: p for name, p in head.named_parameters()}
    names["d2t"] = head.d2t
    return names


@torch.no_grad()
def init_random_eagle3(head: Eagle3Head, seed: int = 0, std: float = 0.02) -> None:
    """Random weights (benchmarks, tests): normal(0, std) matrices, unit norms, and a d2t
    that maps the draft vocabulary onto a random sorted subset of the target's."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in head.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    c = head.config
    targets = torch.randperm(c.vocab_size, generator=gen)[:c.draft_vocab_size].sort().values
    head.d2t.copy_(targets - torch.arange(c.draft_vocab_size))
    head.t2d.zero_()[targets.to(head.t2d.device)] = True
