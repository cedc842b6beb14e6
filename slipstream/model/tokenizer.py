"""A thin wrapper over a transformers fast tokenizer, for a model folder or a GGUF file.

`load_tokenizer(source)` takes the same sources as `slipstream.model.loader.load_model`
(None = the embedded SmolLM2) and returns None for a folder without tokenizer files (dummy
benchmark models).  For GGUF the tokenizer is rebuilt from the file's metadata by
transformers (`PreTrainedTokenizerFast(gguf_file=...)`); we call the fast-tokenizer class
directly because `AutoTokenizer` would first parse the whole GGUF again to build a config,
which costs several seconds.  Even so the rebuild takes 3-4 s (measured on 2 CPU cores), and
every engine, server and replica process pays it: the rebuilt tokenizer is saved once
(`tokenizer.json` + config) under the user's cache, keyed by the GGUF file's path, size and
modification time and by the transformers version, and later loads read it (~0.25 s).
`SLIPSTREAM_CACHE_DIR` moves the cache (default `$XDG_CACHE_HOME/slipstream` or
`~/.cache/slipstream`); a cache that cannot be written or read is skipped.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ChatOptionError(ValueError):
    """A chat option that cannot apply; `param` names the request field it came from."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatOptions:
    """How a chat becomes a prompt; the fields are vLLM's request fields of the same meaning.

    add_generation_prompt: end with the assistant's turn header (the template's own switch).
    continue_final_message: end inside the last message instead, so generation continues it
      (an assistant message that was begun); needs add_generation_prompt off.
    template_kwargs: extra variables for the template (`chat_template_kwargs`, e.g. Qwen3's
      {"enable_thinking": false}).
    template: a Jinja chat template used instead of the tokenizer's own.
    tools: the tools offered to the model (OpenAI's {"type": "function", "function": {...}}
      list), for the template to show, as transformers passes them.
    """
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    template: str | None = None
    tools: list[dict[str, Any]] | None = None

    def over(self, defaults: "ChatOptions") -> "ChatOptions":
        """These options on top of a server's defaults: the template and each template
        variable this request does not set come from `defaults`."""
        return ChatOptions(self.add_generation_prompt, self.continue_final_message,
                           {**defaults.template_kwargs, **self.template_kwargs},
                           self.template or defaults.template, self.tools)

    def check(self, messages: list[dict[str, Any]], reserved: frozenset[str]) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise ChatOptionError("continue_final_message",
                                  "continue_final_message needs add_generation_prompt to be false")
        if self.continue_final_message and not (messages and messages[-1].get("content")):
            raise ChatOptionError("continue_final_message",
                                  "continue_final_message needs a last message with content to continue")
        if not isinstance(self.template_kwargs, dict):
            raise ChatOptionError("chat_template_kwargs", "chat_template_kwargs must be an object")
        taken = sorted(k for k in self.template_kwargs if not isinstance(k, str) or k in reserved)
        if taken:
            raise ChatOptionError("chat_template_kwargs",
                                  f"chat_template_kwargs may not set {', '.join(map(str, taken))} "
                                  "(arguments of the template call itself)")


@functools.lru_cache(maxsize=None)
def _template_arguments(tokenizer_class: type) -> frozenset[str]:
    """Names template variables may not take: the template call's own arguments."""
    params = inspect.signature(tokenizer_class.apply_chat_template).parameters.items()
    names = {n for n, p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return frozenset((names - {"self"}) | {"messages", "conversation"})


def check_text(name: str, text: str) -> str:
    """`text` if a tokenizer can take it: UTF-8 encodable, so no lone surrogate ("\\ud800",
    which JSON and Python strings can carry); else a ValueError naming `name`."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} holds a lone surrogate {text[e.start]!r} at character {e.start}: "
                         "text must be valid Unicode (UTF-8 encodable)") from None
    return text


class Tokenizer:
    def __init__(self, hf_tokenizer, extra_eos_ids=()):
        self.hf = hf_tokenizer
        eos = {hf_tokenizer.eos_token_id} if hf_tokenizer.eos_token_id is not None else set()
        self.eos_token_ids: set[int] = eos | {int(i) for i in extra_eos_ids}
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.vocab_size: int = len(hf_tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with BOS if (and as) the model's tokenizer adds one, unless
        `add_special_tokens` is false. ValueError for a text with a lone surrogate (callers
        that know the text's field check it first, `check_text`, to name it)."""
        return self.hf.encode(check_text("the text", text), add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(_as_list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return self.hf.convert_ids_to_tokens(_as_list(ids))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def render_chat(self, messages: list[dict[str, Any]], options: ChatOptions | None = None) -> str:
        """The prompt text of a chat: by default ending with the assistant's generation prompt.
        ChatOptionError names a bad option; ValueError says why the template failed."""
        options = options or ChatOptions()
        template = options.template or getattr(self.hf, "chat_template", None)
        if not template:
            raise ChatOptionError("messages",
                f"the tokenizer of {self.hf.name_or_path or 'this model'} has no chat template; "
                "send a plain prompt instead of chat messages, or give a chat template")
        options.check(messages, _template_arguments(type(self.hf)))
        try:
            return self.hf.apply_chat_template(
                messages, chat_template=template, add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message, tokenize=False,
                **({"tools": options.tools} if options.tools else {}), **options.template_kwargs)
        except Exception as e:  # the template's own rules (role order, ...), or a bad template
            raise ValueError(f"the chat template rejected the messages: {e}") from None

    def apply_chat_template(self, messages: list[dict[str, Any]], options: ChatOptions | None = None,
                            add_special_tokens: bool = False) -> list[int]:
        # The template writes every special token itself (BOS included where the model wants
        # it), so by default the rendered text is encoded without adding any (vLLM's
        # `add_special_tokens` on chat requests asks for the tokenizer's too).
        return self.encode(check_text("messages", self.render_chat(messages, options)), add_special_tokens)

    def __repr__(self) -> str:
        return (f"Tokenizer({type(self.hf).__name__}, vocab_size={self.vocab_size}, "
                f"eos={sorted(self.eos_token_ids)})")


def _as_list(ids) -> list[int]:
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


def _config_eos_ids(folder: str) -> set[int]:
    """eos ids stated by config.json / generation_config.json (Llama 3.1 lists several)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(i) for i in eos)
    return ids


def load_tokenizer(source: str | os.PathLike | None) -> Tokenizer | None:
    from slipstream.model.loader import resolve_model_source

    path = resolve_model_source(source)
    if path.endswith(".gguf"):
        from transformers import PreTrainedTokenizerFast

        from slipstream.model.gguf import GGUFFile

        cached = _gguf_cache_folder(path)
        hf = _load_cached(PreTrainedTokenizerFast, cached)
        if hf is None:
            folder, name = os.path.split(path)
            try:
                hf = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
            except Exception:  # older transformers: let AutoTokenizer pick the class
                from transformers import AutoTokenizer
                hf = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            _save_cached(hf, cached)
        md = GGUFFile(path).metadata
        extra = [md[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.eom_token_id") if k in md]
        return Tokenizer(hf, extra)
    folder = os.path.dirname(path) if path.endswith(".json") else path
    if not any(os.path.isfile(os.path.join(folder, f)) for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return Tokenizer(AutoTokenizer.from_pretrained(folder), _config_eos_ids(folder))


def _gguf_cache_folder(path: str) -> str | None:
    """Where the tokenizer rebuilt from GGUF file `path` is cached (None: no usable cache)."""
    import transformers
    try:
        st = os.stat(path)
    except OSError:
        return None
    root = os.environ.get("SLIPSTREAM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "slipstream")
    key = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return os.path.join(root, "gguf-tokenizers", hashlib.sha256(key.encode()).hexdigest()[:24])


def _load_cached(cls, folder: str | None):
    if folder is None or not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return None
    try:
        return cls.from_pretrained(folder)
    except Exception:  # a damaged entry: drop it, rebuild from the GGUF file
        shutil.rmtree(folder, ignore_errors=True)
        return None


def _save_cached(hf, folder: str | None) -> None:
    """Save into a temporary folder, then rename it into place, so that processes loading
    at the same time see a whole entry or none."""
    if folder is None:
        return
    try:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(folder), prefix=".tmp-")
        hf.save_pretrained(tmp)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process saved it first
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception:  # a read-only home, a full disk: build it again next time
        pass
