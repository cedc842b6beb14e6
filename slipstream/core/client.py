"""Start an engine core (a thread of this process, or a process of its own) and talk to it.

Both run the same loop (`service.run_core`) over two ZMQ sockets that this side binds:
`inproc://` for a thread, `ipc://` in a private folder for a process.  The process is
started as `python -m slipstream.core` with its config as JSON (no pickles).
`wait_ready` returns the core's `CoreInfo` or raises its startup error as one line.
"""
from __future__ import annotations

import atexit
import dataclasses
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import zmq

from slipstream.config import EngineConfig
from slipstream.core.messages import (Abort, Call, CoreInfo, Ready, Shutdown, StartupFailed, encoder,
                                      from_core_decoder)
from slipstream.utils.process import new_socket
from slipstream.errors import EngineDeadError

CORE_MODES = ("thread", "process")
_STARTUP_ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError, "TypeError": ValueError}


SOCKET_FOLDER_PREFIX = "slipstream-core-"


def socket_folder() -> str:
    """A new private folder for a process core's sockets, named after this process (so a
    later start can tell it is stale) and removed at this process's exit. Stale folders
    (their owner is gone: killed, or never shut down) are removed first."""
    remove_stale_socket_folders(tempfile.gettempdir())
    folder = tempfile.mkdtemp(prefix=f"{SOCKET_FOLDER_PREFIX}{os.getpid()}-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


def remove_stale_socket_folders(root: str) -> list[str]:
    """Remove the socket folders under `root` whose owner process no longer exists; returns them."""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        owner = name[len(SOCKET_FOLDER_PREFIX):].split("-", 1)[0]
        if name.startswith(SOCKET_FOLDER_PREFIX) and owner.isdigit() and not _process_exists(int(owner)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # (OverflowError: no pid is that large)
        return False
    except PermissionError:  # another user's process
        return True
    return True


class CoreClient:
    """The front end's end of the two sockets. `send` may be called from any thread."""

    def __init__(self, config: EngineConfig, mode: str = "process", env: dict | None = None) -> None:
        if mode not in CORE_MODES:
            raise ValueError(f"core must be one of {list(CORE_MODES)}, got {mode!r}")
        self.mode = mode
        self.ctx = zmq.Context()
        self.in_sock = new_socket(self.ctx, zmq.PUSH)   # front end -> core
        self.out_sock = new_socket(self.ctx, zmq.PULL)  # core -> front end
        self._send_lock = threading.Lock()
        self._call_ids = itertools.count()
        self.info: CoreInfo | None = None
        self.proc: subprocess.Popen | None = None
        self.thread: threading.Thread | None = None
        self._dir = None
        if mode == "thread":
            tag = f"{os.getpid()}-{id(self)}"
            in_addr, out_addr = f"inproc://core-in-{tag}", f"inproc://core-out-{tag}"
        else:
            self._dir = socket_folder()
            in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self.in_sock.bind(in_addr)
        self.out_sock.bind(out_addr)
        if mode == "thread":
            self.thread = threading.Thread(target=self._thread_main, args=(config, in_addr, out_addr),
                                           name="slipstream-core", daemon=True)
            self.thread.start()
        else:
            config_json = json.dumps(dataclasses.asdict(config))
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "slipstream.core", config_json, in_addr, out_addr,
                 str(os.getpid())], stdin=subprocess.DEVNULL,
                env=None if env is None else {**os.environ, **env})

    def _thread_main(self, config, in_addr, out_addr) -> None:
        from slipstream.core.service import run_core
        in_sock, out_sock = new_socket(self.ctx, zmq.PULL), new_socket(self.ctx, zmq.PUSH)
        in_sock.connect(in_addr)
        out_sock.connect(out_addr)
        try:
            run_core(config, in_sock, out_sock)
        finally:
            in_sock.close()
            out_sock.close()

    # -- liveness ---------------------------------------------------------------------
    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return self.thread is not None and self.thread.is_alive()

    def exit_description(self) -> str:
        if self.proc is not None:
            return f"the engine core process exited (code {self.proc.poll()})"
        return "the engine core thread ended"

    def wait_ready(self, timeout: float | None = None) -> CoreInfo:
        """Block until the core is built; raise its startup error (one line) if it failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.out_sock.poll(200):
            if not self.alive():
                self.close()
                raise RuntimeError(self.exit_description() + " while starting")
            if deadline is not None and time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the engine core did not start within {timeout:.0f} s")
        msg = from_core_decoder.decode(self.out_sock.recv())
        if isinstance(msg, StartupFailed):
            self.close()
            raise _STARTUP_ERRORS.get(msg.kind, RuntimeError)(msg.message)
        assert isinstance(msg, Ready), f"expected Ready, got {type(msg).__name__}"
        self.info = msg.info
        return msg.info

    # -- messages ---------------------------------------------------------------------
    def send(self, msg) -> None:
        self.send_many([msg])

    def send_many(self, msgs) -> None:
        """Queue messages for the core. Never blocks: with no high-water mark a PUSH socket
        would block only when no core is connected, i.e. when it is gone."""
        data = [encoder.encode(m) for m in msgs]
        with self._send_lock:
            try:
                for d in data:
                    self.in_sock.send(d, zmq.NOBLOCK)
            except zmq.Again:
                raise EngineDeadError(self.exit_description() if not self.alive()
                                      else "the engine core is not connected") from None

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests in the core (nothing to do when the core is gone)."""
        if request_ids:
            try:
                self.send(Abort(list(request_ids)))
            except (EngineDeadError, zmq.ZMQError):
                pass

    def new_call(self, method: str, args: list | None = None) -> Call:
        return Call(next(self._call_ids), method, list(args or []))

    def recv(self, timeout_ms: int):
        """The next message from the core, or None after `timeout_ms`; raises EngineDeadError
        when the core is gone without a word."""
        if self.out_sock.poll(timeout_ms):
            return from_core_decoder.decode(self.out_sock.recv())
        if not self.alive():
            raise EngineDeadError(self.exit_description())
        return None

    # -- shutdown ---------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        if self.ctx.closed:
            return
        if self.alive():
            try:
                self.send(Shutdown())
            except (EngineDeadError, zmq.ZMQError):
                pass  # no core connected: it is exiting or gone
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)
        self.in_sock.close(0)
        self.out_sock.close(0)
        if self.thread is None or not self.thread.is_alive():  # (term waits for every socket)
            self.ctx.term()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
