"""Batch inference over Ray Data (`slipstream.ray.build_processor`) on a local Ray cluster
with the embedded SmolLM2 on the CPU: 100 rows (text prompts, chats, per-row seeded
sampling, a bad row) through 2 replicas equal one `LLM.generate` call, every row once, in
input order with preserve_order, other columns passed through; a replica killed mid-job
is replaced and the job completes, every row once; `slipstream generate --ray` reads JSONL
and writes one Parquet file, reads Parquet and writes one JSONL file, and the same JSONL
file through `generate --input` without Ray gives the same output columns. The cluster is the
session's (`ray_cluster`, tests/conftest.py)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import ray

from slipstream import LLM, SamplingParams
from slipstream.cli.main import main as cli_main
from slipstream.frontend.prompts import chat_token_ids
from slipstream.ray import build_processor

pytestmark = pytest.mark.ray

ENGINE = dict(device="cpu", max_model_len=128, max_num_seqs=32)
DEFAULTS = dict(max_tokens=3, temperature=0.0)
# 100 rows in 8 blocks of ~12, batches of 8: each block splits into a full and a partial
# batch (16 batches); each replica gets ~50 rows, more than the 32 it runs at once (4
# concurrent batches of 8 = max_num_seqs), so batches queue at it and its engine runs full
ROWS, BATCH = 100, 8


def make_rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        row = {"id": i, "tag": f"t{i}", "prompt": f"{i} + {i} ="}
        if i % 10 == 3:  # a chat
            row = {"id": i, "tag": f"t{i}", "messages": [{"role": "user", "content": f"Say {i}."}]}
        if i % 10 == 7:  # its own sampling: seeded, so it does not depend on the batch
            row["sampling_params"] = {"temperature": 0.8, "seed": i, "max_tokens": 2}
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def reference():
    """What one LLM.generate call gives for each row id."""
    rows = make_rows(ROWS)
    llm = LLM(None, **ENGINE)
    prompts, params = [], []
    for r in rows:
        prompts.append(chat_token_ids(r["messages"], llm.tokenizer) if "messages" in r else r["prompt"])
        params.append(SamplingParams.from_dict({**DEFAULTS, **r.get("sampling_params", {})}))
    outs = llm.generate(prompts, params)
    llm.shutdown()
    return {r["id"]: (o.text, o.token_ids, o.finish_reason, len(o.prompt_token_ids))
            for r, o in zip(rows, outs)}


def check_rows(out: list[dict], reference: dict, ids, tagged: bool = True) -> None:
    assert sorted(r["id"] for r in out) == sorted(ids)  # every row exactly once
    for r in out:
        if tagged:
            assert r["tag"] == f"t{r['id']}"
        assert r["error"] is None, r
        want = reference[r["id"]]
        got = (r["generated_text"], list(r["generated_tokens"]), r["finish_reason"], r["num_input_tokens"])
        assert got == want, (r["id"], got, want)
        assert r["num_generated_tokens"] == len(want[1])
        assert r["time_taken_llm"] > 0


def test_100_rows_on_2_replicas_equal_llm_generate(reference, ray_cluster):
    rows = make_rows(ROWS)
    rows.append({"id": ROWS, "tag": f"t{ROWS}", "prompt": "bad", "sampling_params": {"top_p": 2.0}})
    processor = build_processor(replicas=2, cpus_per_replica=0.5, sampling_params=DEFAULTS,
                                batch_size=BATCH, preserve_order=True, **ENGINE)
    out = processor(ray.data.from_items(rows, override_num_blocks=8)).take_all()
    assert [r["id"] for r in out] == list(range(ROWS + 1))  # preserve_order
    bad = out.pop()
    assert bad["finish_reason"] == "error" and "top_p" in bad["error"] and bad["tag"] == f"t{ROWS}"
    check_rows(out, reference, range(ROWS))


def _replica_pids() -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if cmd.startswith(b"ray::MapWorker") and b"EngineReplica" in cmd:
                pids.append(int(entry))
    return pids


def test_killed_replica_is_replaced_and_the_job_completes(reference, ray_cluster):
    ids = range(48)
    rows = make_rows(48)
    processor = build_processor(replicas=2, cpus_per_replica=0.5, sampling_params=DEFAULTS,
                                batch_size=4, max_concurrent_batches=2, **ENGINE)
    out, failure = [], []
    earlier = set(_replica_pids())  # (an earlier test's replicas may still be shutting down)

    def consume():
        try:
            for row in processor(ray.data.from_items(rows, override_num_blocks=12)).iter_rows():
                out.append(row)
        except Exception as e:  # noqa: BLE001 - reported below
            failure.append(e)

    job = threading.Thread(target=consume)
    job.start()
    deadline = time.monotonic() + 240
    while not out and job.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)  # until the first results are back: both replicas are up and working
    pids = [p for p in _replica_pids() if p not in earlier]
    assert len(pids) == 2 and job.is_alive() and len(out) < 48, (pids, len(out))
    os.kill(pids[0], signal.SIGKILL)
    job.join(300)
    assert not job.is_alive() and not failure, failure
    check_rows(out, reference, ids)
    assert pids[0] not in _replica_pids()


def test_generate_cli_jsonl_to_parquet_and_back(ray_cluster, reference, tmp_path, capsys):
    """One JSONL file (flat and nested sampling fields, no extra columns) through
    `generate --input` with --ray and without: the same output columns, row by row."""
    import pyarrow.parquet as pq

    from slipstream.ray import OUTPUT_COLUMNS

    rows = [{k: v for k, v in r.items() if k != "tag"} for r in make_rows(6)]
    rows[1]["max_tokens"] = 3  # the command line's value, flat and nested: the same results
    rows[2]["sampling_params"] = {"max_tokens": 3}
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out_parquet = tmp_path / "out.parquet"
    engine = ["--device", "cpu", "--max-model-len", "128", "--max-tokens", "3", "--quiet"]
    common = ["--ray", "--replicas", "1", "--batch-size", "4", *engine]
    assert cli_main(["generate", "--input", str(src), "--output", str(out_parquet), *common]) == 0
    assert "wrote 6 results" in capsys.readouterr().err
    table = pq.read_table(out_parquet)  # one file
    check_rows(table.to_pylist(), reference, range(6), tagged=False)
    out_jsonl = tmp_path / "again.jsonl"
    assert cli_main(["generate", "--input", str(out_parquet), "--output", str(out_jsonl),
                     "--preserve-order", *common]) == 0
    lines = [json.loads(x) for x in out_jsonl.read_text().splitlines()]
    # --preserve-order keeps the input's order: the Parquet file's, written as rows finished
    assert [r["id"] for r in lines] == [r["id"] for r in table.to_pylist()]
    check_rows(lines, reference, range(6), tagged=False)

    out_local = tmp_path / "local.jsonl"
    assert cli_main(["generate", "--input", str(src), "--output", str(out_local), *engine]) == 0
    local = {r["id"]: r for r in map(json.loads, out_local.read_text().splitlines())}
    assert all(list(r) == ["id", *OUTPUT_COLUMNS] for r in local.values())
    columns = [c for c in OUTPUT_COLUMNS if c != "time_taken_llm"]
    assert {str(r["id"]): [r[c] for c in columns] for r in lines} == \
        {rid: [r[c] for c in columns] for rid, r in local.items()}


def test_bad_arguments_fail_before_any_actor_starts(tmp_path, capsys):
    with pytest.raises(ValueError, match="replicas"):
        build_processor(replicas=0)
    with pytest.raises(ValueError, match="unknown engine option"):
        build_processor(no_such_option=1)
    with pytest.raises(ValueError, match="temperature"):
        build_processor(sampling_params={"temperature": -1})
    assert cli_main(["generate", "--ray", "--input", str(tmp_path / "none.jsonl"),
                     "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
