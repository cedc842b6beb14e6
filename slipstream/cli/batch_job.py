"""JSONL batch jobs: `slipstream generate --input IN.jsonl --output OUT.jsonl`.

Each input line is an object with one of "prompt" (text), "prompt_token_ids" (ints) or
"messages" (a chat; content as a string or OpenAI text parts), an optional "id", and
optional sampling fields overriding the command-line defaults (null = the command line's
value) and, for a chat, "chat_template_kwargs" (over --chat-template-kwargs, key by key),
"add_generation_prompt" and "continue_final_message".  A bad line fails alone, as its own result line.  Results are written and flushed
as each request finishes; `--resume` skips ids already in the output.  Ctrl-C / SIGTERM
stop the job: what is written stays, the rest can be resumed.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from slipstream.frontend.prompts import normalize_messages
from slipstream.sampling.params import SamplingParams
from slipstream.model.tokenizer import ChatOptions

INPUT_KEYS = ("prompt", "prompt_token_ids", "messages")
CHAT_KEYS = ("chat_template_kwargs", "add_generation_prompt", "continue_final_message")


@dataclass
class Job:
    id: str
    line: int
    prompt: object = None  # str | list[int] | list[dict] (messages)
    is_chat: bool = False
    chat: ChatOptions | None = None  # how a chat becomes its prompt
    params: SamplingParams | None = None
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
    jobs, first_line = [], {}
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            job = _parse(raw, n, defaults, chat, chat_defaults or ChatOptions())
            if job.id in first_line and not job.error:
                job.error = f"line {n}: duplicate id {job.id!r} (first on line {first_line[job.id]})"
            first_line.setdefault(job.id, n)
            jobs.append(job)
    return jobs


def _parse(raw: bytes, n: int, defaults: dict, chat: bool, chat_defaults: ChatOptions) -> Job:
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
    rid = obj.pop("id", None)
    job = Job(str(n) if rid is None else str(rid), n)
    inputs = [k for k in INPUT_KEYS if k in obj]
    if len(inputs) != 1:
        job.error = f"line {n}: give exactly one of prompt, prompt_token_ids, messages"
        return job
    key = inputs[0]
    job.prompt = obj.pop(key)
    job.is_chat = key == "messages" or (chat and key == "prompt")
    job.error = _check_prompt(job, key, n)
    if job.error:
        return job
    job.chat, job.error = _chat_options({k: obj.pop(k) for k in CHAT_KEYS if k in obj},
                                        chat_defaults, job.is_chat, n)
    if job.error:
        return job
    sampling = {k: v for k, v in obj.items() if v is not None}  # null: the command line's value
    try:
        job.params = SamplingParams.from_dict({**defaults, **sampling})
    except ValueError as e:
        job.error = f"line {n}: {e}"
    return job


def _chat_options(fields: dict, defaults: ChatOptions, is_chat: bool,
                  n: int) -> tuple[ChatOptions | None, str | None]:
    """A line's chat options over the command line's; (None, error) if they are bad."""
    fields = {k: v for k, v in fields.items() if v is not None}
    if not is_chat:
        if fields:
            return None, f"line {n}: {', '.join(fields)} apply to chats only (messages, or --chat)"
        return None, None
    kwargs = fields.get("chat_template_kwargs", {})
    if not isinstance(kwargs, dict):
        return None, f"line {n}: chat_template_kwargs must be an object"
    for k in ("add_generation_prompt", "continue_final_message"):
        if not isinstance(fields.get(k, False), bool):
            return None, f"line {n}: {k} must be true or false"
    own = ChatOptions(fields.get("add_generation_prompt", True),
                      fields.get("continue_final_message", False), kwargs)
    return own.over(defaults), None


def _check_prompt(job: Job, key: str, n: int) -> str | None:
    p = job.prompt
    if key == "prompt_token_ids":
        if not (isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)):
            return f"line {n}: prompt_token_ids must be a non-empty list of ints"
        return None
    if key == "prompt" and not isinstance(p, str):
        return f"line {n}: prompt must be a string (token ids go in prompt_token_ids)"
    if job.is_chat:
        if isinstance(p, str):
            job.prompt = p = [{"role": "user", "content": p}]
        try:
            job.prompt = normalize_messages(p)
        except ValueError as e:
            return f"line {n}: {e}"
    return None


def result_row(out) -> dict:
    """One output line of a finished request."""
    row = {"id": out.request_id, "text": out.text, "token_ids": out.token_ids,
           "finish_reason": out.finish_reason, "num_prompt_tokens": len(out.prompt_token_ids)}
    if out.logprobs is not None:
        row["logprobs"] = [{str(t): lp for t, lp in entry.items()} for entry in out.logprobs]
    if out.prompt_logprobs is not None:
        row["prompt_logprobs"] = [None if e is None else {str(t): lp for t, lp in e.items()}
                                  for e in out.prompt_logprobs]
    if len(out.outputs) > 1:
        row["outputs"] = [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                           "finish_reason": c.finish_reason} for c in out.outputs]
    if out.error:
        row["error"] = out.error
    return row


def run_job(llm, jobs: list[Job], write, skip: set[str] = frozenset(), on_result=None) -> tuple[int, int]:
    """Queue every runnable job, write each result as it finishes; returns (ok, failed).
    KeyboardInterrupt (Ctrl-C, or SIGTERM turned into it) propagates after aborting."""
    from slipstream.frontend.prompts import chat_token_ids
    ok = failed = 0
    for job in jobs:
        if job.id in skip:
            continue
        if not job.error:
            try:
                prompt = chat_token_ids(job.prompt, llm.tokenizer, job.chat) if job.is_chat else job.prompt
                llm.add_request(prompt, job.params, request_id=job.id)
                continue
            except (ValueError, TypeError) as e:
                job.error = f"line {job.line}: {e}"
        write({"id": job.id, "error": job.error, "finish_reason": "error"})
        failed += 1
    try:
        for out in llm.outputs():
            write(result_row(out))
            ok, failed = (ok, failed + 1) if out.error else (ok + 1, failed)
            if on_result:
                on_result()
    except KeyboardInterrupt:
        for rid in list(llm.processor.requests):
            llm.abort_request(rid)
        raise
    return ok, failed
