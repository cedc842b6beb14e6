"""JSONL batch jobs for `slipstream generate --input ... --output ...`.

Each input line is an object with one of "prompt" (text), "prompt_token_ids" (ints)
or "messages" (a chat), an optional "id", and optional sampling fields overriding the
command-line defaults (e.g. "max_tokens", "temperature", "stop").  A bad line is
reported as that line's error; the other lines still run.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from slipstream.sampling_params import SamplingParams


@dataclass
class Job:
    id: str
    prompt: object = None  # str | list[int] | list[dict] (messages)
    is_chat: bool = False
    params: SamplingParams | None = None
    error: str | None = None


def read_jsonl(path: str, defaults: dict, chat: bool) -> list[Job]:
    jobs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            jobs.append(_parse(line, n, defaults, chat))
    return jobs


def _parse(line: str, n: int, defaults: dict, chat: bool) -> Job:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return Job(str(n), error=f"line {n}: not valid JSON ({e.msg})")
    if not isinstance(obj, dict):
        return Job(str(n), error=f"line {n}: expected a JSON object")
    job = Job(str(obj.pop("id", n)))
    inputs = [k for k in ("prompt", "prompt_token_ids", "messages") if k in obj]
    if len(inputs) != 1:
        job.error = f"line {n}: give exactly one of prompt, prompt_token_ids, messages"
        return job
    job.prompt = obj.pop(inputs[0])
    job.is_chat = inputs[0] == "messages" or (chat and inputs[0] == "prompt")
    if job.is_chat and isinstance(job.prompt, str):
        job.prompt = [{"role": "user", "content": job.prompt}]
    try:
        job.params = SamplingParams.from_dict({**defaults, **obj})
    except ValueError as e:
        job.error = f"line {n}: {e}"
    return job


def run_job(llm, jobs: list[Job], use_tqdm: bool = True) -> list[dict]:
    results: dict[str, dict] = {}
    runnable = []
    for job in jobs:
        if job.error:
            results[job.id] = {"id": job.id, "error": job.error}
            continue
        try:
            if job.is_chat and llm.tokenizer is None:
                raise ValueError("chat needs a tokenizer with a chat template; this model has none")
            prompt = llm.tokenizer.apply_chat_template(job.prompt) if job.is_chat else job.prompt
            rid = llm.engine.add_request(prompt, job.params, request_id=job.id)
            runnable.append(rid)
        except (ValueError, TypeError) as e:
            results[job.id] = {"id": job.id, "error": str(e)}
    for out in llm._run(runnable, use_tqdm):
        results[out.request_id] = {
            "id": out.request_id, "text": out.text, "token_ids": out.token_ids,
            "finish_reason": out.finish_reason, "num_prompt_tokens": len(out.prompt_token_ids),
            **({"error": out.error} if out.error else {})}
    return [results[j.id] for j in jobs if j.id in results]


def write_jsonl(path: str | None, rows: list[dict]) -> None:
    f = open(path, "w") if path else sys.stdout
    try:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    finally:
        if path:
            f.close()
