"""JSONL batch jobs: `slipstream generate --input IN.jsonl --output OUT.jsonl`.

Each line is one row of `slipstream.frontend.batch_rows` (the rows `generate --ray` reads
too), its `id` the line number when it has none.  A bad line fails alone, as its own result
line naming the line and the field.  Results are written and flushed as each request
finishes, one row of `OUTPUT_COLUMNS` each after its `id`; `--resume` skips ids already in
the output.  Ctrl-C / SIGTERM stop the job: what is written stays, the rest can be resumed.
A request that failed because the engine died (not because of its own input) is not written:
it did not run, and `--resume` runs it.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from slipstream.errors import EngineDeadError
from slipstream.frontend.batch_rows import BatchRow, RowDefaults, RowResult, parse_row, result_of, row_id
from slipstream.model.tokenizer import ChatOptions


@dataclass
class Job:
    id: str
    line: int
    row: BatchRow | None = None  # None when the line could not be parsed
    error: str | None = None


def check_paths(input_path: str, output_path: str | None) -> None:
    """Before the model loads: the input is readable, the output is writable and not the input."""
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"--input {input_path}: no such file")
    if output_path is None:
        return
    if os.path.abspath(output_path) == os.path.abspath(input_path) or (
            os.path.exists(output_path) and os.path.samefile(output_path, input_path)):
        raise ValueError(f"--output {output_path} is the input file; write the results elsewhere")
    folder = os.path.dirname(os.path.abspath(output_path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"--output {output_path}: the folder {folder} does not exist")
    if os.path.isdir(output_path) or not os.access(folder, os.W_OK) or (
            os.path.exists(output_path) and not os.access(output_path, os.W_OK)):
        raise ValueError(f"--output {output_path} is not a writable file")


def done_ids(output_path: str | None) -> set[str]:
    """Ids already written to `output_path` (for --resume)."""
    ids: set[str] = set()
    if output_path and os.path.isfile(output_path):
        with open(output_path, "rb") as f:
            for raw in f:
                try:
                    row = json.loads(raw)
                except ValueError:
                    continue  # a line cut off by a crash: that request runs again
                if isinstance(row, dict) and "id" in row:
                    ids.add(str(row["id"]))
    return ids


def read_jsonl(path: str, defaults: dict, chat: bool,
               chat_defaults: ChatOptions | None = None) -> list[Job]:
    """The jobs of a JSONL file; `defaults` and `chat_defaults` are the command line's
    sampling fields and chat options, `chat` its --chat (a text prompt is a user message)."""
    row_defaults = RowDefaults(dict(defaults), chat_defaults or ChatOptions(), chat)
    jobs, first_line = [], {}
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            job = parse_line(raw, n, row_defaults)
            if job.id in first_line and not job.error:
                job.error = f"line {n}: duplicate id {job.id!r} (first on line {first_line[job.id]})"
            first_line.setdefault(job.id, n)
            jobs.append(job)
    return jobs


def parse_line(raw: bytes, n: int, defaults: RowDefaults) -> Job:
    """Line `n` of the file as a job; a bad line is a job holding its one-line error."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Job(str(n), n, error=f"line {n}: not valid UTF-8 (byte {e.start})")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return Job(str(n), n, error=f"line {n}: not valid JSON ({e.msg})")
    if not isinstance(obj, dict):
        return Job(str(n), n, error=f"line {n}: expected a JSON object")
    try:
        rid = row_id(obj)
    except ValueError as e:
        return Job(str(n), n, error=f"line {n}: {e}")
    job = Job(str(n) if rid is None else rid, n)
    try:
        job.row = parse_row(obj, defaults)
    except ValueError as e:
        job.error = f"line {n}: {e}"
    return job


def result_row(out) -> dict:
    """One output line of a finished request: its id, then the row result's columns and,
    when asked for, logprobs, prompt logprobs and (n > 1) every completion."""
    row = {"id": out.request_id, **asdict(result_of(out))}
    if out.logprobs is not None:
        row["logprobs"] = [{str(t): lp for t, lp in entry.items()} for entry in out.logprobs]
    if out.prompt_logprobs is not None:
        row["prompt_logprobs"] = [None if e is None else {str(t): lp for t, lp in e.items()}
                                  for e in out.prompt_logprobs]
    if len(out.outputs) > 1:
        row["outputs"] = [{"index": c.index, "generated_text": c.text, "generated_tokens": c.token_ids,
                           "finish_reason": c.finish_reason} for c in out.outputs]
    return row


def error_row(rid: str, error: str) -> dict:
    """The output line of a job that could not run."""
    return {"id": rid, **asdict(RowResult(error=error))}


@dataclass
class JobCounts:
    """How a job's requests ended: written ok, written as failed (their own input, or the
    engine could never run them), and not run (the engine died first: not written)."""
    ok: int = 0
    failed: int = 0
    not_run: int = 0


def run_job(llm, jobs: list[Job], write, skip: set[str] = frozenset(), on_result=None) -> JobCounts:
    """Queue every runnable job, write each result as it finishes. A request ended by the
    engine's death is not written (it did not run; --resume runs it), nor is any job left
    when the engine is dead. KeyboardInterrupt (Ctrl-C, or SIGTERM turned into it)
    propagates after aborting."""
    counts = JobCounts()
    for job in jobs:
        if job.id in skip:
            continue
        if not job.error:
            if llm.dead_error is not None:
                counts.not_run += 1
                continue
            try:
                llm.add_request(job.row.engine_prompt(llm.tokenizer), job.row.params, request_id=job.id)
                continue
            except EngineDeadError:
                counts.not_run += 1
                continue
            except (ValueError, TypeError) as e:
                job.error = f"line {job.line}: {e}"
        write(error_row(job.id, job.error))
        counts.failed += 1
    try:
        for out in llm.outputs():
            if out.error is not None and out.error == llm.dead_error:
                counts.not_run += 1  # the engine failed, not this request's input
                continue
            write(result_row(out))
            if out.error:
                counts.failed += 1
            else:
                counts.ok += 1
            if on_result:
                on_result()
    except KeyboardInterrupt:
        for rid in list(llm.processor.requests):
            llm.abort_request(rid)
        raise
    return counts
