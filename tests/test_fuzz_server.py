"""Schemathesis over the server's own OpenAPI document (/openapi.json), every endpoint, on the
fake engine in process: bounded (a fixed seed and example budget, about a minute on CI) and
reproducible. The property: no 5xx; every 4xx carries an error object; the server answers a
good request after each case."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

schemathesis = pytest.importorskip("schemathesis")
from fake_async_llm import FakeAsyncLLM  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from slipstream.server.app import build_app  # noqa: E402

FLAGS = dict(served_model_name=None, api_key=None, max_waiting=None, stream_interval=1,
             max_body_bytes=1 << 16, max_num_seqs=4)
APP = build_app(FakeAsyncLLM(max_model_len=256), SimpleNamespace(**FLAGS))
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", APP)
GOOD = {"prompt": "hi", "max_tokens": 2}


@pytest.mark.slow
@SCHEMA.parametrize()
@settings(max_examples=25, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_case_is_a_server_error_and_the_server_answers_after(case):
    response = case.call()
    assert response.status_code < 500, (case.method, case.path, case.body, response.text)
    if 400 <= response.status_code < 500 and response.status_code != 499:
        error = response.json()["error"]
        assert error["code"] == response.status_code and error["message"]
    from starlette.testclient import TestClient
    with TestClient(APP) as client:
        assert client.post("/v1/completions", json=GOOD).status_code == 200
