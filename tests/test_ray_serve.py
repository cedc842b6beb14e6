"""`slipstream serve --data-parallel-size 2 --ray-address local`: the replicas are Ray
actors (of a Ray instance the server starts); requests spread over both, streams work, and
a replica whose actor process is killed is replaced while the other keeps serving."""
from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from server_utils import ServerProcess, metric

pytestmark = [pytest.mark.subprocess, pytest.mark.ray]  # `slipstream serve` on Ray actors


def _actor_pids() -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().startswith(b"ray::EngineActor"):
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def _complete(url: str, prompt: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120,
                      json={"prompt": prompt, "max_tokens": 3, "temperature": 0})


def test_replicas_as_ray_actors(tmp_path):
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    srv = ServerProcess("--data-parallel-size", "2", "--ray-address", "local", "--max-model-len", "256",
                        log_path=str(tmp_path / "server.log"))
    try:
        texts = [_complete(srv.url, f"Count {i}:") for i in range(4)]
        assert all(r.status_code == 200 for r in texts), [r.text for r in texts]
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=120,
                          json={"prompt": "Hi", "max_tokens": 3, "stream": True}) as r:
            lines = [x for x in r.iter_lines() if x]
        assert lines[-1] == "data: [DONE]" and len(lines) == 4
        page = httpx.get(srv.url + "/metrics", timeout=30).text
        routed = [metric(page, "slipstream:replica_requests_routed_total", replica=str(i)) for i in range(2)]
        assert sum(routed) == 5 and min(routed) >= 2, routed
        pids = _actor_pids()
        assert len(pids) == 2, pids
        os.kill(pids[0], signal.SIGKILL)
        ok = 0
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            r = _complete(srv.url, f"Again {ok}:")
            ok += r.status_code == 200  # (a request sent before the death is seen may fail)
            page = httpx.get(srv.url + "/metrics", timeout=30).text
            if sum(metric(page, "slipstream:replica_restarts_total", replica=str(i)) for i in range(2)) == 1 \
                    and all(metric(page, "slipstream:replica_up", replica=str(i)) == 1 for i in range(2)):
                break
            time.sleep(0.5)
        else:
            raise AssertionError("the killed replica was not replaced:\n" + page)
        assert ok >= 1 and len(_actor_pids()) == 2
        assert _complete(srv.url, "After:").status_code == 200
    finally:
        assert srv.terminate() == 0
