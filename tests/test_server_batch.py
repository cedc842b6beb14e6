"""`slipstream run-batch` end to end on the CPU: chat and completion lines succeed, bad
lines (not JSON, a wrong url, an invalid body) each get their own error line."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.subprocess  # `slipstream run-batch` as a process


def test_run_batch_with_bad_lines(tmp_path):
    lines = [
        json.dumps({"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "smol", "messages": [{"role": "user", "content": "Hi"}],
                             "max_completion_tokens": 3, "temperature": 0}}),
        json.dumps({"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "smol", "prompt": "The capital of France is",
                             "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1}}),
        "{not json",
        json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}}),
        json.dumps({"custom_id": "bad-body", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "smol", "prompt": "x", "temperature": -1}}),
        json.dumps({"custom_id": "bad-model", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "nope", "prompt": "x"}}),
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "-m", "slipstream.cli", "run-batch", "-i", str(src),
                           "-o", str(dst), "--device", "cpu", "--served-model-name", "smol"],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["custom_id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    assert len(rows) == 6 and None in rows
    chat = rows["chat-1"]
    assert chat["error"] is None and chat["response"]["status_code"] == 200
    body = chat["response"]["body"]
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 3
    cmpl = rows["cmpl-1"]["response"]["body"]
    assert cmpl["choices"][0]["text"].startswith("The capital of France is")
    assert cmpl["choices"][0]["logprobs"]["token_logprobs"][0] is None
    assert "not valid JSON" in rows[None]["error"]["message"] and rows[None]["response"] is None
    assert "url must be one of" in rows["bad-url"]["error"]["message"]
    bad = rows["bad-body"]
    assert bad["response"]["status_code"] == 400 and "temperature" in bad["error"]["message"]
    assert bad["response"]["body"]["error"]["code"] == 400
    assert rows["bad-model"]["response"]["status_code"] == 404
    assert "1 requests" not in proc.stderr and "6 requests, 4 failed" in proc.stderr
