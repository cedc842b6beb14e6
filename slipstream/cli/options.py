"""Command-line options shared by the sub-commands: the engine's and the chat template's."""
from __future__ import annotations

import argparse
import json
import os

from slipstream.model.tokenizer import ChatOptions


def engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF folder (config.json + safetensors) or .gguf file; default: embedded SmolLM2-135M-Instruct")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step, the prefill chunk budget (default 16384 on GPUs of "
                        ">= 70 GiB, else 8192)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--async-scheduling", dest="async_scheduling", action="store_true", default=None,
                   help="overlap CPU scheduling with GPU compute (default on CUDA)")
    g.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--cuda-graph-max-tokens", type=int, default=None,
                   help="largest prefill/mixed step run as a CUDA graph (default "
                        "--max-num-batched-tokens; 0: those steps run eagerly)")
    g.add_argument("--cuda-graph-shared-from", type=int, default=None,
                   help="decode batches of at least this many rows, and prefill/mixed steps, "
                        "replay one CUDA graph shared by the two IO slots: about half the "
                        "captures at start, for 1-2%% of throughput (default: a graph per slot)")
    g.add_argument("--cuda-graph-clone", action=argparse.BooleanOptionalAction, default=True,
                   help="clone the second IO slot's CUDA graphs from the first slot's instead of "
                        "capturing them: half the captures at start, the same steps (default: on)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="results independent of batch composition (slower; GPU)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the model over N GPUs (N worker processes; gloo on the CPU)")


def engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(model=a.model, load_format=a.load_format, dtype=a.dtype, device=a.device,
                max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=a.max_num_batched_tokens, block_size=a.block_size,
                gpu_memory_utilization=a.gpu_memory_utilization,
                enable_prefix_caching=a.enable_prefix_caching, async_scheduling=a.async_scheduling,
                enforce_eager=a.enforce_eager, cuda_graph_max_tokens=a.cuda_graph_max_tokens,
                cuda_graph_shared_from=a.cuda_graph_shared_from, cuda_graph_clone=a.cuda_graph_clone,
                batch_invariant=a.batch_invariant, tensor_parallel_size=a.tensor_parallel_size)


def chat_args(p: argparse.ArgumentParser, kwargs_flag: str = "--chat-template-kwargs") -> None:
    g = p.add_argument_group("chat template")
    g.add_argument("--chat-template", default=None, metavar="TEMPLATE_OR_FILE",
                   help="a Jinja chat template, or a file holding one, instead of the tokenizer's")
    g.add_argument(kwargs_flag, dest="chat_template_kwargs", default=None, metavar="JSON",
                   help="extra chat template variables, e.g. '{\"enable_thinking\": false}'"
                        + (" (a request's chat_template_kwargs override them key by key)"
                           if kwargs_flag.startswith("--default") else ""))


def chat_defaults(a: argparse.Namespace) -> ChatOptions:
    """The chat template flags as ChatOptions; ValueError names a bad flag."""
    template, raw = getattr(a, "chat_template", None), getattr(a, "chat_template_kwargs", None)
    if template is not None:
        template = read_chat_template(template)
    kwargs = {}
    if raw is not None:
        try:
            kwargs = json.loads(raw)
        except ValueError:
            kwargs = None
        if not isinstance(kwargs, dict):
            raise ValueError(f"the chat template kwargs must be a JSON object, got {raw!r}")
    return ChatOptions(template_kwargs=kwargs, template=template)


def read_chat_template(value: str) -> str:
    """A template given inline (it has Jinja tags) or as a file."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template")
