"""The JSONL batch job, `slipstream generate --input IN.jsonl --output OUT.jsonl`, on the CPU
with the tiny random Llama of `tokenized_tiny` (SmolLM2 tokenizer): results streamed and
flushed, --resume, path checks before the model loads, duplicate ids, bad lines failing alone,
null sampling fields, logprobs, SIGTERM mid-job followed by --resume, flat and nested
sampling fields giving the same result, and the output schema shared with `generate --ray`
(tests/test_batch_rows.py: the rows themselves)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from slipstream.cli.main import main

COMMON = ["--device", "cpu", "--quiet", "--max-model-len", "256"]
RESULT_KEYS = ["id", "generated_text", "generated_tokens", "num_input_tokens", "num_generated_tokens",
               "time_taken_llm", "finish_reason", "error"]  # every row, in this order


def write_jsonl(path, rows) -> None:
    """rows: dicts (dumped as JSON) or bytes (written as they are); one line each."""
    with open(path, "wb") as f:
        for r in rows:
            f.write(r if isinstance(r, bytes) else json.dumps(r).encode())
            f.write(b"\n")


def read_rows(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def generate(model, src, dst, *extra) -> int:
    return main(["generate", "--model", model, "--input", str(src), "--output", str(dst),
                 *COMMON, *extra])


def stderr_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# --- one mixed job, run once: good lines, bad lines, a duplicate, null fields, logprobs ---

GOOD = [
    {"id": "p1", "prompt": "Hello there", "max_tokens": 4},
    {"id": "p1_nested", "prompt": "Hello there", "sampling_params": {"max_tokens": 4}},
    {"id": "t1", "prompt_token_ids": [1, 300, 301, 302], "max_tokens": 4},
    {"id": "m1", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    {"id": "parts", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]}], "max_tokens": 4},
    {"id": "null", "prompt": "Count with me", "max_tokens": None, "ignore_eos": True,
     "temperature": None},
    {"id": "lp", "prompt": "Tell me", "max_tokens": 4, "logprobs": 2, "ignore_eos": True},
    {"id": "dup", "prompt": "first of two", "max_tokens": 4},
]
BAD = {  # id -> (line, words its error must hold)
    "no_role": ({"id": "no_role", "messages": [{"content": "Hi"}]}, ["role"]),
    "no_content": ({"id": "no_content", "messages": [{"role": "user"}]}, ["content"]),
    "wizard": ({"id": "wizard", "messages": [{"role": "wizard", "content": "Hi"}]}, ["wizard"]),
    "ids_str": ({"id": "ids_str", "prompt_token_ids": [1, "a"]}, ["prompt_token_ids"]),
    "ids_float": ({"id": "ids_float", "prompt_token_ids": [1.5]}, ["prompt_token_ids"]),
    "image": ({"id": "image", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, ["image_url"]),
    "twice": ({"id": "twice", "prompt": "x", "max_tokens": 2, "sampling_params": {"max_tokens": 3}},
              ["max_tokens is given both at the top level and in sampling_params"]),
    "typo": ({"id": "typo", "prompt": "x", "max_token": 2}, ["unknown key 'max_token'"]),
    "sp_list": ({"id": "sp_list", "prompt": "x", "sampling_params": [2]},
                ["sampling_params must be an object"]),
    "sp_typo": ({"id": "sp_typo", "prompt": "x", "sampling_params": {"temprature": 1}}, ["temprature"]),
}


@pytest.fixture(scope="module")
def mixed_job(tokenized_tiny, tmp_path_factory):
    """Runs the mixed job once; records, at each finished result, what the output file holds."""
    import slipstream.cli.batch_job as bj

    folder = tmp_path_factory.mktemp("mixed")
    src, dst = folder / "in.jsonl", folder / "out.jsonl"
    lines = list(GOOD[:-1]) + [b'{"id": "utf8", "prompt": "caf\xff\xfe"}']
    lines += [row for row, _ in BAD.values()]
    lines += [GOOD[-1], {"id": "dup", "prompt": "second of two", "max_tokens": 4}]
    write_jsonl(src, lines)
    line_of = {}
    for n, r in enumerate(lines, 1):
        line_of.setdefault("utf8" if isinstance(r, bytes) else r["id"], n)

    real_run_job = bj.run_job
    snapshots = []  # (rows written so far, lines in the file then)

    def spy_run_job(llm, jobs, write, skip=frozenset(), on_result=None):
        written = []

        def spy_write(row):
            write(row)
            written.append(row)

        def spy_on_result():
            with open(dst, encoding="utf-8") as f:
                snapshots.append((len(written), [json.loads(x) for x in f if x.strip()]))
            if on_result:
                on_result()

        return real_run_job(llm, jobs, spy_write, skip, on_result=spy_on_result)

    mp = pytest.MonkeyPatch()
    mp.setattr(bj, "run_job", spy_run_job)
    import io
    import contextlib
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            rc = generate(tokenized_tiny, src, dst, "--max-tokens", "3")
    finally:
        mp.undo()
    return dict(rc=rc, stderr=err.getvalue(), rows=read_rows(dst), dst=str(dst),
                snapshots=snapshots, line_of=line_of, n_lines=len(lines))


def by_id(rows) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["id"], []).append(r)
    return out


@pytest.mark.slow
def test_results_are_flushed_one_line_each_as_requests_finish(mixed_job):
    assert mixed_job["rc"] == 0
    snaps = mixed_job["snapshots"]
    assert len(snaps) == len(GOOD)  # on_result once per finished request
    for n_written, on_disk in snaps:  # everything written is already on disk, flushed
        assert len(on_disk) == n_written
    assert [n for n, _ in snaps] == sorted({n for n, _ in snaps})  # one more line each time
    assert len(mixed_job["rows"]) == mixed_job["n_lines"]
    for r in mixed_job["rows"]:
        assert list(r)[:len(RESULT_KEYS)] == RESULT_KEYS, r  # one schema, failed lines too
        if r["error"] is None:
            assert isinstance(r["generated_tokens"], list) and r["generated_tokens"]
            assert r["num_generated_tokens"] == len(r["generated_tokens"])
            assert isinstance(r["generated_text"], str) and r["num_input_tokens"] > 0
            assert isinstance(r["time_taken_llm"], float) and r["time_taken_llm"] > 0
            assert r["finish_reason"] in ("length", "stop")
        else:
            assert r["generated_tokens"] is None and r["finish_reason"] == "error"


def test_summary_line_on_stderr(mixed_job):
    n_bad = len(BAD) + 2  # + the UTF-8 line and the duplicate
    lines = stderr_lines(mixed_job["stderr"])
    assert lines[-1] == (f"wrote {mixed_job['n_lines']} results to {mixed_job['dst']}: "
                         f"{len(GOOD)} ok, {n_bad} failed")


def test_duplicate_id_fails_the_later_line_only(mixed_job):
    rows = by_id(mixed_job["rows"])["dup"]
    assert len(rows) == 2
    ok = [r for r in rows if r["error"] is None]
    bad = [r for r in rows if r["error"] is not None]
    assert len(ok) == 1 and ok[0]["generated_tokens"]
    assert len(bad) == 1 and bad[0]["finish_reason"] == "error"
    first = mixed_job["line_of"]["dup"]
    assert "duplicate" in bad[0]["error"] and "'dup'" in bad[0]["error"]
    assert f"line {first + 1}" in bad[0]["error"] and f"first on line {first}" in bad[0]["error"]


def test_bad_lines_fail_alone(mixed_job):
    rows = by_id(mixed_job["rows"])
    for rid, (_, words) in BAD.items():
        (row,) = rows[rid]
        assert row["finish_reason"] == "error" and row["generated_tokens"] is None, row
        assert f"line {mixed_job['line_of'][rid]}" in row["error"], row
        for w in words:
            assert w in row["error"], row
    for g in GOOD:
        good = [r for r in rows[g["id"]] if r["error"] is None]
        assert len(good) == 1 and good[0]["generated_tokens"], g


def test_flat_and_nested_sampling_fields_give_the_same_result(mixed_job):
    rows = by_id(mixed_job["rows"])
    (flat,), (nested,) = rows["p1"], rows["p1_nested"]
    assert nested["error"] is None and len(nested["generated_tokens"]) == 4
    assert (flat["generated_tokens"], flat["generated_text"]) == (nested["generated_tokens"], nested["generated_text"])


def test_undecodable_line_names_its_line_and_utf8(mixed_job):
    (row,) = by_id(mixed_job["rows"])[str(mixed_job["line_of"]["utf8"])]
    assert row["finish_reason"] == "error"
    assert f"line {mixed_job['line_of']['utf8']}" in row["error"] and "UTF-8" in row["error"]


def test_openai_text_parts_are_accepted(mixed_job):
    (row,) = by_id(mixed_job["rows"])["parts"]
    assert row["error"] is None and row["generated_tokens"]
    (plain,) = by_id(mixed_job["rows"])["m1"]  # "Hi there" is longer than "Hi"
    assert row["num_input_tokens"] > plain["num_input_tokens"]


def test_null_sampling_field_means_the_command_line_value(mixed_job):
    (row,) = by_id(mixed_job["rows"])["null"]
    assert row["error"] is None
    assert len(row["generated_tokens"]) == 3 and row["finish_reason"] == "length"


def test_logprobs_are_written(mixed_job):
    (row,) = by_id(mixed_job["rows"])["lp"]
    lps = row["logprobs"]
    assert isinstance(lps, list) and len(lps) == len(row["generated_tokens"]) == 4
    for tok, entry in zip(row["generated_tokens"], lps):
        assert isinstance(entry, dict) and entry
        assert all(isinstance(k, str) and k.lstrip("-").isdigit() for k in entry)
        assert all(isinstance(v, float) for v in entry.values())
        assert str(tok) in entry  # the sampled token's own logprob is there
    (plain,) = by_id(mixed_job["rows"])["p1"]
    assert "logprobs" not in plain


# --- --resume ---

@pytest.mark.slow
def test_resume_skips_ids_already_written(tokenized_tiny, tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = [f"r{i}" for i in range(5)]
    write_jsonl(src, [{"id": i, "prompt": f"number {i}", "max_tokens": 2} for i in ids])
    done = [{"id": "r1", "generated_text": "HAND WRITTEN 1", "generated_tokens": [7], "finish_reason": "length",
             "num_input_tokens": 1},
            {"id": "r3", "generated_text": "HAND WRITTEN 3", "generated_tokens": [9], "finish_reason": "length",
             "num_input_tokens": 1}]
    write_jsonl(dst, done)
    before = dst.read_bytes()
    assert generate(tokenized_tiny, src, dst, "--resume") == 0
    after = dst.read_bytes()
    assert after.startswith(before)  # appended, the hand-written lines untouched
    rows = read_rows(dst)
    assert rows[:2] == done
    counts = {i: sum(r["id"] == i for r in rows) for i in ids}
    assert counts == {i: 1 for i in ids}
    assert all(r["error"] is None and r["generated_tokens"] for r in rows[2:])
    assert stderr_lines(capsys.readouterr().err)[-1].startswith(f"wrote 3 results to {dst}: 3 ok, 0 failed")


@pytest.mark.slow
def test_resume_after_a_cut_off_last_line(tokenized_tiny, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, [{"id": i, "prompt": f"number {i}", "max_tokens": 2} for i in ("a", "b")])
    dst.write_bytes(b'{"id": "a", "generated_text": "x", "generated_tokens": [1], "finish_reason": "length", '
                    b'"num_input_tokens": 1}\n{"id": "b", "te')
    assert generate(tokenized_tiny, src, dst, "--resume") == 0
    lines = dst.read_bytes().split(b"\n")
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except ValueError:
            pass
    assert sum(isinstance(r, dict) and r.get("id") == "b" and "generated_tokens" in r for r in parsed) == 1


# --- paths checked before the model loads ---

def test_output_equal_to_input_is_refused_before_the_model_loads(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"prompt": "hi"}])
    before = src.read_bytes()
    rc = generate("/nonexistent/model", src, src)
    err = capsys.readouterr().err
    assert rc == 2
    assert "--output" in err and str(src) in err and "input" in err
    assert "nonexistent" not in err
    assert src.read_bytes() == before  # not truncated


def test_output_in_a_missing_folder_is_refused_before_the_model_loads(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"prompt": "hi"}])
    dst = tmp_path / "no" / "such" / "out.jsonl"
    rc = generate("/nonexistent/model", src, dst)
    err = capsys.readouterr().err
    assert rc == 2
    assert str(dst) in err and "does not exist" in err
    assert "/nonexistent/model" not in err


def test_same_file_through_another_name_is_refused(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"prompt": "hi"}])
    link = tmp_path / "link.jsonl"
    os.symlink(src, link)
    assert generate("/nonexistent/model", src, link) == 2
    assert "is the input file" in capsys.readouterr().err


# --- SIGTERM mid-job, then --resume ---

@pytest.mark.subprocess
def test_sigterm_stops_cleanly_and_resume_finishes(tokenized_tiny, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    n = 40
    ids = [f"s{i}" for i in range(n)]
    # a few short ones so a result lands early, the rest long enough to still be running
    write_jsonl(src, [{"id": rid, "prompt": f"request {i}", "ignore_eos": True,
                       "max_tokens": 2 if i < 2 else 200} for i, rid in enumerate(ids)])
    cmd = [sys.executable, "-m", "slipstream.cli", "generate", "--model", tokenized_tiny,
           "--input", str(src), "--output", str(dst), *COMMON, "--max-num-seqs", "8"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if dst.exists() and dst.read_bytes().count(b"\n") >= 1:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate(timeout=10)
        assert dst.exists() and dst.read_bytes().count(b"\n") >= 1, "no result within 60 s"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    err = err.decode()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    lines = stderr_lines(err)
    assert len(lines) == 1 and lines[0].startswith("interrupted"), err
    first = read_rows(dst)  # every line written is whole JSON
    assert 1 <= len(first) < n
    assert all(r["error"] is None and r["generated_tokens"] for r in first)

    # the rest: shorter, so the resume run is quick
    write_jsonl(src, [{"id": rid, "prompt": f"request {i}", "ignore_eos": True, "max_tokens": 2}
                      for i, rid in enumerate(ids)])
    done = subprocess.run(cmd + ["--resume"], capture_output=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    rows = read_rows(dst)
    assert rows[:len(first)] == first
    counts = {rid: sum(r["id"] == rid for r in rows) for rid in ids}
    assert counts == {rid: 1 for rid in ids}
    assert f"{len(first)} already done" in done.stderr.decode()

