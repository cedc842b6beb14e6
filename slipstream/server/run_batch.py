"""`slipstream run-batch`: an OpenAI Batch API input file through the same validation and
serving functions as the HTTP server.

Input lines: ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions", "body": {...}}``. Output lines, written and flushed as each request
finishes (so not in input order): ``{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}``; ``error`` is null on success, else ``{"code",
"message"}`` (the response then carries the error object as its body, or is null when the
line itself could not be read).
"""
from __future__ import annotations

import asyncio
import json
import uuid

from slipstream.server.app import parse_json
from slipstream.server.errors import APIError, error_body
from slipstream.server.protocol import ChatCompletionRequest, CompletionRequest
from slipstream.server.serving_chat import complete_chat, prepare_chat
from slipstream.server.serving_common import ServingState, off_loop
from slipstream.server.serving_completions import complete, prepare_completion

ENDPOINTS = {
    "/v1/completions": (CompletionRequest, prepare_completion, complete),
    "/v1/chat/completions": (ChatCompletionRequest, prepare_chat, complete_chat),
}


def _line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def _failure(custom_id, status: int | None, message: str, code: str) -> dict:
    response = None
    if status is not None:
        response = {"status_code": status, "request_id": f"batch-{uuid.uuid4().hex}",
                    "body": error_body(status, message)}
    return {"id": _line_id(), "custom_id": custom_id, "response": response,
            "error": {"code": code, "message": message}}


def read_line(n: int, line: str):
    """(custom_id, url, body text) of one input line, or raise ValueError."""
    try:
        row = json.loads(line)
    except ValueError as e:
        raise ValueError(f"line {n}: not valid JSON: {e}") from None
    if not isinstance(row, dict):
        raise ValueError(f"line {n}: expected a JSON object")
    custom_id = row.get("custom_id")
    if row.get("method", "POST") != "POST":
        raise ValueError(f"line {n}: method must be POST, got {row.get('method')!r}")
    url = row.get("url")
    if url not in ENDPOINTS:
        raise ValueError(f"line {n}: url must be one of {', '.join(ENDPOINTS)}, got {url!r}")
    if not isinstance(row.get("body"), dict):
        raise ValueError(f"line {n}: body must be a JSON object")
    return custom_id, url, row["body"]


async def run_one(state: ServingState, custom_id, url: str, body: dict) -> dict:
    model, prepare, run = ENDPOINTS[url]
    request_id = f"batch-{uuid.uuid4().hex}"
    try:
        if body.get("stream"):
            raise APIError(400, "stream is not supported in a batch", "stream")
        req = parse_json(json.dumps(body), model)
        result = await run(state, await off_loop(state, prepare, state, req))
    except APIError as e:
        out = _failure(custom_id, e.status, e.message, error_body(e.status, "")["error"]["type"])
        out["response"]["request_id"] = request_id
        return out
    return {"id": _line_id(), "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": result},
            "error": None}


async def run_batch(state: ServingState, lines, write, max_concurrency: int = 256) -> tuple[int, int]:
    """Run every line; `write(dict)` each result as it finishes. Returns (done, failed)."""
    sem = asyncio.Semaphore(max_concurrency)
    counts = [0, 0]

    def emit(row: dict) -> None:
        counts[0] += 1
        counts[1] += row["error"] is not None
        write(row)

    async def one(custom_id, url, body):
        async with sem:
            try:
                row = await run_one(state, custom_id, url, body)
            except Exception as e:  # an engine failure: this line fails alone
                row = _failure(custom_id, 500, f"{type(e).__name__}: {e}", "InternalServerError")
        emit(row)

    tasks = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            custom_id, url, body = read_line(n, line)
        except ValueError as e:
            cid = None
            try:
                cid = json.loads(line).get("custom_id")
            except Exception:
                pass
            emit(_failure(cid, None, str(e), "invalid_request"))
            continue
        tasks.append(asyncio.ensure_future(one(custom_id, url, body)))
    if tasks:
        await asyncio.gather(*tasks)
    return counts[0], counts[1]
