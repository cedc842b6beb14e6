"""Command-line options shared by the sub-commands: the engine's (generated from
EngineConfig's table of options) and the chat template's."""
from __future__ import annotations

import argparse
import json
import os
from types import MappingProxyType

from slipstream.config import EngineOption, engine_options
from slipstream.model.tokenizer import ChatOptions

# `slipstream bench` times the engine on a workload's architecture: random weights, and the
# timeline its step breakdown is read from
BENCH_ENGINE_DEFAULTS = MappingProxyType({"load_format": "dummy", "trace": True})
_METAVARS = MappingProxyType({int: "N", float: "X"})


def engine_defaults(overrides: dict | None = None) -> dict:
    """Each engine option's default, with a command's own `overrides` (ValueError names an
    unknown one)."""
    defaults = {opt.name: opt.default for opt in engine_options()}
    unknown = sorted(set(overrides or {}) - set(defaults))
    if unknown:
        raise ValueError(f"unknown engine option(s) {unknown}")
    return {**defaults, **(overrides or {})}


def engine_args(p: argparse.ArgumentParser, defaults: dict | None = None) -> dict[str, argparse.Action]:
    """The engine's flags, one per EngineConfig field, as an argument group of `p`; `defaults`
    overrides some defaults. Returns each option's argparse action by name."""
    values = engine_defaults(defaults)
    g = p.add_argument_group("engine", "engine options (docs/engine-options.md)")
    actions = {}
    for opt in engine_options():
        default = values[opt.name]
        text = f"{opt.help} (default: {shown_default(opt, default)})".replace("%", "%%")
        if opt.type is bool:
            actions[opt.name] = g.add_argument(*opt.flags, dest=opt.name, default=default, help=text,
                                               action=argparse.BooleanOptionalAction)
        else:
            actions[opt.name] = g.add_argument(*opt.flags, dest=opt.name, type=opt.type,
                                               default=default, choices=opt.choices, help=text,
                                               metavar=_METAVARS.get(opt.type))
    return actions


def engine_kwargs(a: argparse.Namespace) -> dict:
    """The engine flags as LLM / EngineConfig keywords."""
    return {opt.name: getattr(a, opt.name) for opt in engine_options()}


def workload_engine_kwargs(a: argparse.Namespace, workload, defaults: dict | None = None) -> dict:
    """The engine options of a benchmark workload's run: a flag moved off its default wins
    over the workload's option; without --model, the workload's model with dummy weights."""
    kwargs, parsed_defaults = engine_kwargs(a), engine_defaults(defaults)
    for name, value in workload.engine.items():
        if kwargs[name] == parsed_defaults[name]:
            kwargs[name] = value
    if kwargs["model"] is None:
        kwargs.update(model=workload.model, load_format="dummy")
    return kwargs


def shown_default(opt: EngineOption, value) -> str:
    if value is None:
        return opt.unset or "none"
    if opt.type is bool:
        return "on" if value else "off"
    return str(value)


def engine_options_markdown() -> str:
    """docs/engine-options.md: the table of engine options (scripts/gen_engine_options_doc.py
    writes it; tests/test_engine_options.py checks the committed file)."""
    by_name = {opt.name: opt for opt in engine_options()}
    flags = {name: action.option_strings
             for name, action in engine_args(argparse.ArgumentParser()).items()}
    lines = ["# Engine options", "",
             "Generated from `EngineConfig` (slipstream/config.py) by "
             "`python scripts/gen_engine_options_doc.py`; do not edit by hand.", "",
             "Each option is a keyword of `LLM(...)`, `AsyncLLM(...)` and `EngineConfig(...)`, and "
             "a flag of `slipstream generate`, `serve`, `run-batch` and `bench`. A boolean's flag "
             "`--X` has its negation `--no-X`. `slipstream bench` has other defaults for "
             + ", ".join(f"`{name}` (`{shown_default(by_name[name], value)}`)"
                         for name, value in BENCH_ENGINE_DEFAULTS.items())
             + "; with `generate --workload` and `bench`, a workload's own options replace the "
             "flags left at their defaults, and without `--model` the workload's model runs "
             "with dummy weights.",
             "", "| Option | CLI flag | Type | Default | Help |", "|---|---|---|---|---|"]
    for opt in engine_options():
        kind = opt.type.__name__ + (" or None" if opt.optional else "")
        if opt.choices is not None:
            kind += ": " + ", ".join(f"`{c}`" for c in opt.choices)
        default = shown_default(opt, opt.default)
        default = f"`{default}`" if opt.default is not None else default
        lines.append(f"| `{opt.name}` | {', '.join(f'`{f}`' for f in flags[opt.name])} | {kind} | {default} | {opt.help} |")
    return "\n".join(lines) + "\n"


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
