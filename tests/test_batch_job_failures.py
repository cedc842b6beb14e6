"""A batch job keeps every good result (issue 48): a poisonous line fails alone; a request
that the engine's death ended is not written as done, the job exits non-zero saying how
many did not run, and `--resume` runs them exactly once; ids must be strings or integers;
an output that cannot be written is a clear error."""
from __future__ import annotations

import json

import pytest

from slipstream.cli.batch_job import parse_line
from slipstream.core.engine_core import EngineCore
from slipstream.frontend.batch_rows import RowDefaults, row_id
from slipstream.cli.main import main

COMMON = ["--device", "cpu", "--quiet", "--max-model-len", "128", "--max-num-seqs", "4"]

GOOD = [{"id": f"g{i}", "prompt_token_ids": [1, 300 + i, 301, 302], "max_tokens": 3, "ignore_eos": True,
         "temperature": 0} for i in range(10)]
POISON = [
    {"id": "neg", "prompt_token_ids": [1, -5]},
    {"id": "huge", "prompt_token_ids": [2 ** 70]},
    {"id": "topk", "prompt_token_ids": [1, 2], "top_k": 3_000_000_000},
    {"id": "stop", "prompt_token_ids": [1, 2], "stop_token_ids": [2 ** 70]},
    {"id": "seed", "prompt_token_ids": [1, 2], "seed": 2 ** 64},
    {"id": {"a": 1}, "prompt_token_ids": [1, 2]},
]


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def generate(model, src, dst, *extra) -> int:
    return main(["generate", "--model", model, "--input", str(src), "--output", str(dst), *COMMON, *extra])


def outcome(rows) -> dict:
    return {r["id"]: (r["generated_tokens"], r["finish_reason"]) for r in rows}


def test_an_id_must_be_a_string_or_an_integer():
    assert row_id({"id": "a"}) == "a" and row_id({"id": 7}) == "7" and row_id({}) is None
    for bad in ({"a": 1}, [1], 1.5, True):
        with pytest.raises(ValueError, match="id must be a string or an integer"):
            row_id({"id": bad})
    job = parse_line(b'{"id": {"a": 1}, "prompt": "x"}', 3, RowDefaults())
    assert job.id == "3" and job.error.startswith("line 3: id must be a string or an integer, got dict")


@pytest.mark.slow
def test_poisonous_lines_fail_alone_and_the_good_results_equal_a_clean_run(tokenized_tiny, tmp_path, capsys):
    clean_in, clean_out = tmp_path / "clean.jsonl", tmp_path / "clean.out.jsonl"
    write_jsonl(clean_in, GOOD)
    assert generate(tokenized_tiny, clean_in, clean_out) == 0
    mixed_in, mixed_out = tmp_path / "mixed.jsonl", tmp_path / "mixed.out.jsonl"
    mixed = GOOD[:5] + POISON + GOOD[5:]
    write_jsonl(mixed_in, mixed)
    assert generate(tokenized_tiny, mixed_in, mixed_out) == 0
    rows = read_rows(mixed_out)
    got = outcome(rows)
    assert {k: v for k, v in got.items() if k.startswith("g")} == outcome(read_rows(clean_out))
    errors = {r["id"]: r["error"] for r in rows if r["error"]}
    line_of_dict_id = mixed.index(POISON[-1]) + 1
    assert set(errors) == {"neg", "huge", "topk", "stop", "seed", str(line_of_dict_id)}
    for rid, field in [("neg", "outside the vocabulary"), ("huge", "outside the vocabulary"),
                       ("topk", "top_k"), ("stop", "stop_token_ids"), ("seed", "seed"),
                       (str(line_of_dict_id), "id must be")]:
        assert field in errors[rid] and "\n" not in errors[rid]
    assert "11 results" not in capsys.readouterr().err  # (16 rows: 10 ok, 6 failed)


@pytest.mark.slow
def test_requests_the_engines_death_ended_are_not_done_and_resume_runs_them_once(
        tokenized_tiny, tmp_path, capsys, monkeypatch):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, GOOD)
    clean = tmp_path / "clean.jsonl"
    assert generate(tokenized_tiny, src, clean) == 0
    real_step, steps = EngineCore.step, []

    def dies_at_the_fourth_step(self):  # some requests end first, the rest are in flight
        steps.append(1)
        if len(steps) == 4:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_step(self)

    monkeypatch.setattr(EngineCore, "step", dies_at_the_fourth_step)
    capsys.readouterr()
    assert generate(tokenized_tiny, src, dst) == 1
    err = capsys.readouterr().err
    written = read_rows(dst)
    assert written and len(written) < len(GOOD) and not any(r["error"] for r in written)
    not_run = len(GOOD) - len(written)
    assert f"{not_run} requests did not run" in err and "--resume" in err and "illegal memory" in err
    monkeypatch.setattr(EngineCore, "step", real_step)
    assert generate(tokenized_tiny, src, dst, "--resume") == 0
    rows = read_rows(dst)
    assert sorted(r["id"] for r in rows) == sorted(g["id"] for g in GOOD)  # each exactly once
    assert outcome(rows) == outcome(read_rows(clean))


@pytest.mark.slow
def test_an_output_that_cannot_be_written_is_a_clear_error(tokenized_tiny, tmp_path, capsys):
    import os
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    src = tmp_path / "in.jsonl"
    write_jsonl(src, GOOD[:2])
    assert generate(tokenized_tiny, src, "/dev/full") == 1
    err = capsys.readouterr().err
    assert "could not write the results to /dev/full" in err and "Traceback" not in err
