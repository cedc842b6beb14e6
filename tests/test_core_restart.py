"""A dead engine core is recovered (issue 48): AsyncLLM with max_core_restarts starts a new core
after a back-off (the requests the dead one held end with an error, is_dead holds until the new
one is ready); once the restarts are spent it is dead for good, and `slipstream serve` exits
non-zero so that a supervisor sees it. Socket folders of dead owners are removed."""
from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time

import httpx
import pytest
from server_utils import ServerProcess, child_pids

from slipstream.core.client import SOCKET_FOLDER_PREFIX, remove_stale_socket_folders
from slipstream.frontend.async_llm import AsyncLLM
from slipstream.sampling.params import SamplingParams


def test_restart_options_are_checked():
    for bad in (dict(max_core_restarts=-1), dict(max_core_restarts=1.5), dict(max_core_restarts=True),
                dict(core_restart_backoff_s=float("nan")), dict(core_restart_backoff_s=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            AsyncLLM(load_format="dummy", device="cpu", **bad)


def test_socket_folders_of_dead_owners_are_removed(tmp_path):
    dead_pid = 2 ** 22 + 12345  # above Linux's pid_max default: no such process
    for name in (f"{SOCKET_FOLDER_PREFIX}{dead_pid}-abc", f"{SOCKET_FOLDER_PREFIX}{os.getpid()}-def",
                 f"{SOCKET_FOLDER_PREFIX}xyz", "other-folder"):
        (tmp_path / name).mkdir()
    assert remove_stale_socket_folders(str(tmp_path)) == [f"{SOCKET_FOLDER_PREFIX}{dead_pid}-abc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{SOCKET_FOLDER_PREFIX}{os.getpid()}-def", f"{SOCKET_FOLDER_PREFIX}xyz", "other-folder"])


async def _until(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.mark.subprocess
def test_async_llm_restarts_a_dead_core_then_is_dead_for_good(tiny_model):
    folder, _ = tiny_model("llama")
    params = SamplingParams(max_tokens=2, ignore_eos=True)

    async def main():
        llm = AsyncLLM(folder, load_format="dummy", device="cpu", max_model_len=64,
                       max_core_restarts=1, core_restart_backoff_s=0.05)
        try:
            first_folder = llm._client._dir
            assert os.path.isdir(first_folder) and f"{SOCKET_FOLDER_PREFIX}{os.getpid()}-" in first_folder
            stream = llm.generate([1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True))
            await stream.__anext__()  # (the request is in the core)
            os.kill(llm.core_pid, signal.SIGKILL)
            outs = [o async for o in stream]
            assert outs[-1].finished and outs[-1].finish_reason == "error"
            await _until(lambda: not llm.is_dead)
            assert llm.core_restarts == 1 and not os.path.exists(first_folder)
            async for out in llm.generate([1, 2, 3], params):
                pass
            assert out.finish_reason == "length" and len(out.token_ids) == 2
            os.kill(llm.core_pid, signal.SIGKILL)
            await _until(lambda: llm.failed_for_good)
            assert llm.core_restarts == 1
        finally:
            await llm.shutdown()

    asyncio.run(main())


@pytest.mark.subprocess
def test_the_server_restarts_its_core_and_exits_non_zero_when_the_restarts_are_spent(tiny_model, tmp_path):
    folder, _ = tiny_model("llama")
    log = tmp_path / "server.log"
    server = ServerProcess("--model", folder, "--load-format", "dummy", "--max-model-len", "64",
                           "--max-core-restarts", "1", "--core-restart-backoff", "0.05",
                           "--log-level", "warning", log_path=str(log))
    try:
        body = {"prompt": [1, 2, 3], "max_tokens": 2}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        (core,) = child_pids(server.proc.pid)
        os.kill(core, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while httpx.get(server.url + "/health", timeout=10).status_code != 200 or \
                child_pids(server.proc.pid) in ([], [core]):
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        (core,) = child_pids(server.proc.pid)
        os.kill(core, signal.SIGKILL)
        assert server.proc.wait(120) == 1
        text = log.read_text()
        assert "restart 1 of 1" in text and "the engine core is back" in text
        assert "will not be restarted" in text
    finally:
        server.kill()
    leftovers = [n for n in os.listdir(tempfile.gettempdir())
                 if n.startswith(f"{SOCKET_FOLDER_PREFIX}{server.proc.pid}-")]
    assert not leftovers
