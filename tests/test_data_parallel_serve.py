"""`slipstream serve --data-parallel-size 2` on the CPU (two engine core processes behind one
endpoint, the embedded SmolLM2): requests spread over both replicas, prompts that share a
prefix go to the replica that has it cached (seen in /metrics), and a replica killed
mid-request ends that request with an error while the other keeps serving; it is restarted.
The same endpoint is the target of `ray.data.llm`'s HttpRequestProcessorConfig: a Ray Data
job of chat rows (on the session's Ray cluster) gets the answers a direct request gets."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
import ray

from server_utils import ServerProcess, child_pids, metric

pytestmark = [pytest.mark.subprocess, pytest.mark.ray]  # `slipstream serve`; Ray Data drives it

PREFIX = ("You are a careful assistant. Answer every question in one short sentence, and never "
          "use more words than you need. Do not repeat the question, do not greet the user, and "
          "do not apologise. If you do not know the answer, say so plainly and stop there. "
          "The question follows after the colon: ")  # > 3 KV blocks of 16 tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-dp") / "server.log"
    srv = ServerProcess("--data-parallel-size", "2", "--max-model-len", "512", "--max-num-seqs", "8",
                        log_path=str(log))
    yield srv
    assert srv.terminate() == 0


def _metrics(server) -> str:
    return httpx.get(server.url + "/metrics", timeout=30).text


def _routed(page: str) -> list[float]:
    return [metric(page, "slipstream:replica_requests_routed_total", replica=str(i)) for i in range(2)]


def _complete(server, prompt: str, max_tokens: int = 2) -> dict:
    r = httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_requests_spread_over_both_replicas(server):
    before = _routed(_metrics(server))
    results = []
    threads = [threading.Thread(target=lambda i=i: results.append(_complete(server, f"Count to {i}:")))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(results) == 6 and all(r["usage"]["completion_tokens"] == 2 for r in results)
    page = _metrics(server)
    delta = [a - b for a, b in zip(_routed(page), before)]
    assert sum(delta) == 6 and min(delta) >= 2, delta
    # the summed families are still there, and equal the sum of the replicas'
    total = metric(page, "slipstream:prefix_cache_queries_total")
    assert total == sum(metric(page, "slipstream:replica_prefix_cache_queries_total", replica=str(i))
                        for i in range(2))
    assert metric(page, "slipstream:replica_up", replica="0") == 1
    assert metric(page, "slipstream:replica_up", replica="1") == 1


def test_shared_prefix_goes_to_the_replica_that_has_it(server):
    page = _metrics(server)
    routed, affine = _routed(page), [metric(page, "slipstream:replica_requests_prefix_routed_total",
                                            replica=str(i)) for i in range(2)]
    hits = [metric(page, "slipstream:replica_prefix_cache_hits_total", replica=str(i)) for i in range(2)]
    for q in ("what is two plus two?", "name a colour.", "what is the capital of Italy?",
              "how many legs has a cat?"):
        _complete(server, PREFIX + q)
    page = _metrics(server)
    d_routed = [a - b for a, b in zip(_routed(page), routed)]
    d_affine = [metric(page, "slipstream:replica_requests_prefix_routed_total", replica=str(i)) - affine[i]
                for i in range(2)]
    d_hits = [metric(page, "slipstream:replica_prefix_cache_hits_total", replica=str(i)) - hits[i]
              for i in range(2)]
    owner = d_routed.index(4)
    assert d_routed[1 - owner] == 0, d_routed
    assert d_affine[owner] == 3 and d_affine[1 - owner] == 0, d_affine
    assert d_hits[owner] >= 3 * 2 and d_hits[1 - owner] == 0, d_hits  # >= 2 blocks per request


def test_ray_data_llm_http_processor_drives_the_endpoint(server, ray_cluster):
    from ray.data.llm import HttpRequestProcessorConfig
    from ray.data.llm import build_processor as ray_build_processor

    questions = [f"What is {i} times {i}?" for i in range(6)]
    model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]

    def payload(q):
        return {"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": 4,
                "temperature": 0}

    config = HttpRequestProcessorConfig(url=server.url + "/v1/chat/completions", max_retries=2,
                                        qps=None, batch_size=3, concurrency=1)
    processor = ray_build_processor(
        config, preprocess=lambda row: {"payload": payload(row["q"]), "i": row["i"]},
        postprocess=lambda row: {"i": row["i"],
                                 "answer": row["http_response"]["choices"][0]["message"]["content"]})
    ds = ray.data.from_items([{"i": i, "q": q} for i, q in enumerate(questions)])
    got = {r["i"]: r["answer"] for r in processor(ds).take_all()}
    assert sorted(got) == list(range(6))
    for i, q in enumerate(questions):
        r = httpx.post(server.url + "/v1/chat/completions", json=payload(q), timeout=120)
        assert got[i] == r.json()["choices"][0]["message"]["content"]


def _stream(server, prompt: str, events: list, first: threading.Event) -> None:
    body = {"prompt": prompt, "max_tokens": 48, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=180) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
                first.set()


def test_killed_replica_fails_its_requests_only_and_restarts(server):
    cores = child_pids(server.proc.pid)
    assert len(cores) == 2, cores
    streams = [([], threading.Event()) for _ in range(2)]
    threads = [threading.Thread(target=_stream, args=(server, f"Tell a story number {i}.", *streams[i]))
               for i in range(2)]
    for t in threads:
        t.start()
    assert all(first.wait(120) for _, first in streams)
    page = _metrics(server)
    assert [metric(page, "slipstream:replica_requests_outstanding", replica=str(i)) for i in range(2)] == [1, 1]
    os.kill(cores[0], signal.SIGKILL)
    for t in threads:
        t.join(180)
    ends = []
    for events, _ in streams:
        assert events[-1] == "[DONE]"
        body = events[-2]
        ends.append("error" if "error" in body else body["choices"][0]["finish_reason"])
    assert sorted(ends) == ["error", "length"], ends
    failed = next(ev[-2] for ev, _ in streams if "error" in ev[-2])
    assert "replica" in failed["error"]["message"] and "died" in failed["error"]["message"]
    # the other replica keeps serving while the dead one restarts
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    for i in range(3):
        assert _complete(server, f"Say {i}.")["usage"]["completion_tokens"] == 2
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        page = _metrics(server)
        if sum(metric(page, "slipstream:replica_restarts_total", replica=str(i)) for i in range(2)) == 1 \
                and all(metric(page, "slipstream:replica_up", replica=str(i)) == 1 for i in range(2)):
            break
        time.sleep(1.0)
    else:
        raise AssertionError("the killed replica was not restarted:\n" + page)
    assert len(child_pids(server.proc.pid)) == 2
    before = _routed(page)
    results = []
    threads = [threading.Thread(target=lambda i=i: results.append(_complete(server, f"Number {i}:")))
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(results) == 4
    assert min(a - b for a, b in zip(_routed(_metrics(server)), before)) >= 1
