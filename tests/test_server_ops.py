"""`slipstream serve` operations, one server for the module (--api-key, --max-num-seqs 2,
--max-waiting 2): the API key guards /v1/* only, overload answers 503 with Retry-After while
every admitted request completes, and SIGTERM lets the requests in flight finish, refuses
new ones with 503 and exits 0 (the last test: it stops the server)."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from server_utils import ServerProcess

pytestmark = pytest.mark.subprocess  # `slipstream serve` processes

KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    srv = ServerProcess("--api-key", KEY, "--max-num-seqs", "2", "--max-waiting", "2",
                        "--shutdown-timeout", "120", log_path=str(log))
    yield srv
    srv.terminate()


def test_api_key_guards_v1_only(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.url + path, timeout=60).status_code == 200
    assert httpx.post(server.url + "/tokenize", json={"prompt": "hi"}, timeout=60).status_code == 200
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    r = good.completions.create(model=good.models.list().data[0].id, prompt="Hi", max_tokens=1)
    assert r.usage.completion_tokens == 1


def _post_many(url: str, n: int, max_tokens: int) -> list[httpx.Response]:
    results: list = [None] * n

    def one(i):
        try:
            results[i] = httpx.post(url + "/v1/completions", headers=AUTH, timeout=240,
                                    json={"prompt": f"Count to {i}:", "max_tokens": max_tokens,
                                          "ignore_eos": True, "temperature": 0})
        except httpx.HTTPError as e:
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(260)
    return results


def test_overload_answers_503_and_admitted_requests_complete(server):
    results = _post_many(server.url, 10, 2)
    assert all(isinstance(r, httpx.Response) for r in results), results
    ok = [r for r in results if r.status_code == 200]
    refused = [r for r in results if r.status_code == 503]
    assert len(ok) + len(refused) == 10 and len(ok) >= 4 and refused
    assert all(r.json()["usage"]["completion_tokens"] == 2 for r in ok)
    for r in refused:
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "ServiceUnavailableError"


def test_sigterm_finishes_requests_in_flight_then_exits_0(server):
    results: list = []
    t = threading.Thread(target=lambda: results.extend(_post_many(server.url, 3, 5)))
    t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait until the requests are in the engine
        page = httpx.get(server.url + "/metrics", timeout=30).text
        if 'slipstream:num_requests_running{model_name="SmolLM2-135M-Instruct"} 2.0' in page:
            break
        time.sleep(0.1)
    server.proc.send_signal(15)
    assert server.wait_for_line("shutting down", 30)
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=30,
                   json={"prompt": "late", "max_tokens": 1})
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
    assert httpx.get(server.url + "/health", timeout=30).status_code == 503
    t.join(240)
    assert [r.status_code for r in results] == [200, 200, 200]
    assert all(r.json()["usage"]["completion_tokens"] == 5 for r in results)
    assert server.proc.wait(120) == 0
