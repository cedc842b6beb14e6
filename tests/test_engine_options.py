"""The table of engine options (EngineConfig's fields) and what is generated from it: every
command's flags, the LLM keywords they become, and docs/engine-options.md."""
from __future__ import annotations

import argparse
import pathlib
import runpy
from dataclasses import fields

import pytest

from slipstream.bench.workloads import Workload
from slipstream.cli.main import build_parser
from slipstream.cli.options import (BENCH_ENGINE_DEFAULTS, engine_args, engine_defaults,
                                    engine_kwargs, engine_options_markdown, workload_engine_kwargs)
from slipstream.config import EngineConfig, engine_options
from slipstream.spec.config import SpeculativeConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
# each command's argv before its engine flags (run-batch has required files)
COMMANDS = {"generate": ["generate"], "serve": ["serve"], "bench": ["bench"],
            "run-batch": ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl"]}


# options whose string value must parse (a JSON object)
OFF_DEFAULT_STRINGS = {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}'}


def _off_default_argv() -> tuple[list[str], dict]:
    """A flag for every option with a value other than its default, and the keywords expected."""
    argv, expected = [], {}
    for opt in engine_options():
        flag = opt.flags[0]
        if opt.type is bool:
            value = not opt.default  # (None: the async_scheduling default, flipped to True)
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            value = OFF_DEFAULT_STRINGS.get(opt.name) or {int: 512, float: 0.5, str: "some/folder"}[opt.type]
            if opt.choices is not None:
                value = opt.choices[-1]
            argv += [flag, str(value)]
        expected[opt.name] = value
    return argv, expected


def test_the_table_is_every_engine_config_field_in_order():
    names = [opt.name for opt in engine_options()]
    assert names == [f.name for f in fields(EngineConfig)]
    assert "cuda_graph_shared_from" not in names
    for opt in engine_options():
        assert opt.help and opt.flags[0].startswith("--") and opt.type in (str, int, float, bool)
        assert opt.default is not None or opt.unset, f"{opt.name}: say what its None default means"
        assert opt.optional or opt.default is not None
    by_name = {opt.name: opt for opt in engine_options()}
    assert by_name["tensor_parallel_size"].flags == ("--tensor-parallel-size", "-tp")
    assert by_name["async_scheduling"].type is bool and by_name["async_scheduling"].optional
    assert by_name["dtype"].choices == ("auto", "float32", "bfloat16", "float16")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_is_a_flag_of_every_command_and_parses_to_its_llm_keyword(command):
    argv, expected = _off_default_argv()
    kwargs = engine_kwargs(build_parser().parse_args(COMMANDS[command] + argv))
    assert kwargs == expected
    config = EngineConfig.from_kwargs(**kwargs)  # the keywords LLM(...) takes
    parsed = {**expected, "speculative_config": SpeculativeConfig(method="ngram", num_speculative_tokens=3)}
    assert {f.name: getattr(config, f.name) for f in fields(config)} == parsed


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_has_the_tables_defaults_bench_its_overrides(command):
    kwargs = engine_kwargs(build_parser().parse_args(COMMANDS[command]))
    overrides = BENCH_ENGINE_DEFAULTS if command == "bench" else None
    assert kwargs == engine_defaults(overrides)
    if command != "bench":
        assert EngineConfig(**kwargs) == EngineConfig()


def test_benchs_flags_differ_from_the_others_only_in_their_defaults():
    plain = engine_args(argparse.ArgumentParser())
    bench = engine_args(argparse.ArgumentParser(), BENCH_ENGINE_DEFAULTS)
    assert plain.keys() == bench.keys()
    differ = set()
    for name in plain:
        a, b = plain[name], bench[name]
        assert (a.option_strings, a.type, a.choices, a.dest, type(a)) == \
               (b.option_strings, b.type, b.choices, b.dest, type(b))
        if a.default != b.default:
            differ.add(name)
    assert differ == set(BENCH_ENGINE_DEFAULTS) == {"load_format", "trace"}
    with pytest.raises(ValueError, match=r"unknown engine option\(s\) \['tracee'\]"):
        engine_defaults({"tracee": True})


def test_booleans_have_both_spellings_and_the_seed_flag_leaves_generates_seed_alone():
    parse = build_parser().parse_args
    assert engine_kwargs(parse(["serve", "--no-prefix-caching"]))["enable_prefix_caching"] is False
    assert engine_kwargs(parse(["serve", "--prefix-caching"]))["enable_prefix_caching"] is True
    assert engine_kwargs(parse(["serve"]))["async_scheduling"] is None
    assert engine_kwargs(parse(["serve", "--async-scheduling"]))["async_scheduling"] is True
    assert engine_kwargs(parse(["serve", "-tp", "2"]))["tensor_parallel_size"] == 2
    a = parse(["generate", "--seed", "7", "--engine-seed", "3", "hi"])
    assert a.sampling_seed == 7 and engine_kwargs(a)["seed"] == 3  # a request's seed, the engine's seed


def test_a_workloads_options_give_way_to_the_flags_moved_off_their_defaults():
    workload = Workload("unit", "configs/unit", [], [], dict(max_num_seqs=4, max_num_batched_tokens=64))
    parse = build_parser().parse_args
    kwargs = workload_engine_kwargs(parse(["bench", "--max-num-batched-tokens", "16"]), workload,
                                    BENCH_ENGINE_DEFAULTS)
    assert kwargs["max_num_batched_tokens"] == 16 and kwargs["max_num_seqs"] == 4
    assert kwargs["model"] == "configs/unit" and kwargs["load_format"] == "dummy" and kwargs["trace"]
    kwargs = workload_engine_kwargs(parse(["generate", "--model", "m", "--max-num-seqs", "8"]), workload)
    assert kwargs["model"] == "m" and kwargs["load_format"] == "auto" and not kwargs["trace"]
    assert kwargs["max_num_seqs"] == 8 and kwargs["max_num_batched_tokens"] == 64


def test_the_committed_doc_is_the_one_the_table_generates():
    doc = (ROOT / "docs" / "engine-options.md").read_text(encoding="utf-8")
    assert doc == engine_options_markdown(), "run: python scripts/gen_engine_options_doc.py"
    rows = [line for line in doc.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [opt.name for opt in engine_options()]
    assert "| `enable_prefix_caching` | `--prefix-caching`, `--no-prefix-caching` | bool | `on` |" in doc
    script = runpy.run_path(str(ROOT / "scripts" / "gen_engine_options_doc.py"))
    assert script["main"](["--check"]) == 0
