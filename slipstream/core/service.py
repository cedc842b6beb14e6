"""The core's own loop: drain the inbox, step while there is work, block when idle.

`run_core` builds an `EngineCore` and serves it over two ZMQ sockets (PULL for messages
from the front end, PUSH for its outputs), in a thread of the caller's process
(`inproc://`) or in a process of its own (`python -m slipstream.core`, `ipc://`).
An exception inside a step marks the core dead: one `CoreDead` carries the death and the
error outputs of every open request, and the loop returns.  A core process exits when its parent dies.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import traceback

import zmq

from slipstream.config import EngineConfig
from slipstream.utils.process import new_socket
from slipstream.core.messages import (Abort, AddRequest, Call, CallResult, CoreDead, Ready,
                                      StartupFailed, StepOutputs, encoder, to_core_decoder)

IDLE_POLL_MS = 1000  # an idle core wakes this often, only to see whether its parent is alive


class _Inbox:
    def __init__(self, sock: zmq.Socket, parent_pid: int | None) -> None:
        self.sock = sock
        self.parent_pid = parent_pid

    def parent_gone(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def drain(self, block: bool) -> list:
        """Every message waiting now; when `block`, wait for at least one."""
        msgs = []
        while block and not self.sock.poll(IDLE_POLL_MS):
            if self.parent_gone():
                return [None]
        while True:
            try:
                msgs.append(to_core_decoder.decode(self.sock.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return msgs


def run_core(config: EngineConfig, in_sock: zmq.Socket, out_sock: zmq.Socket,
             parent_pid: int | None = None) -> None:
    from slipstream.core.engine_core import EngineCore
    from slipstream.utils.process import freeze_gc
    try:
        core = EngineCore(config)
    except BaseException as e:  # noqa: BLE001 - every startup failure reaches the caller as one line
        out_sock.send(encoder.encode(StartupFailed(_one_line(e), type(e).__name__)))
        return
    if parent_pid is not None:
        freeze_gc()  # this process keeps one engine (engine_core.freeze_gc)
    out_sock.send(encoder.encode(Ready(core.info)))
    try:
        _serve(core, _Inbox(in_sock, parent_pid), out_sock)
    finally:
        core.close()


def _serve(core, inbox: _Inbox, out_sock: zmq.Socket) -> None:
    """The loop. Messages are handled between steps; a step that raised ends everything."""
    send = out_sock.send
    while True:
        for msg in inbox.drain(block=not core.has_work()):
            if msg is None or not isinstance(msg, (AddRequest, Abort, Call)):
                return  # Shutdown, or the parent died
            try:
                _handle(core, msg, send)
            except Exception as e:  # noqa: BLE001 - a bug: the engine is dead, say so
                return _die(core, e, send)
        if inbox.parent_gone():
            return
        if core.has_work():
            try:
                outputs = core.step()
            except Exception as e:  # noqa: BLE001 - CUDA error, bug: the engine is dead
                return _die(core, e, send)
            if outputs:
                send(encoder.encode(StepOutputs(outputs)))


def _handle(core, msg, send) -> None:
    if isinstance(msg, AddRequest):
        core.add(msg)
    elif isinstance(msg, Abort):
        core.abort(msg.request_ids)
    else:
        try:
            result = core.call(msg.method, msg.args)
            send(encoder.encode(CallResult(msg.call_id, result)))
        except (ValueError, TypeError, RuntimeError) as e:
            send(encoder.encode(CallResult(msg.call_id, error=_one_line(e))))


def dead_message(e: BaseException) -> str:
    return f"the engine core failed: {_one_line(e)}"


def _die(core, e: BaseException, send) -> None:
    message = dead_message(e)
    traceback.print_exc(file=sys.stderr)
    try:
        send(encoder.encode(CoreDead(message, core.fail_all(message))))
    except zmq.ZMQError:
        pass


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:2000]


def main(argv: list[str]) -> int:
    """Entry of a core process (slipstream/core/__main__.py): CONFIG_JSON IN OUT PARENT_PID."""
    config_json, in_addr, out_addr, parent_pid = argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front end's to handle
    ctx = zmq.Context()
    in_sock, out_sock = new_socket(ctx, zmq.PULL, 2000), new_socket(ctx, zmq.PUSH, 2000)
    in_sock.connect(in_addr)
    out_sock.connect(out_addr)
    try:
        config = EngineConfig.from_kwargs(**json.loads(config_json))
    except (ValueError, TypeError) as e:
        out_sock.send(encoder.encode(StartupFailed(_one_line(e), "ValueError")))
        return 1
    run_core(config, in_sock, out_sock, parent_pid=int(parent_pid))
    in_sock.close(0)
    out_sock.close()
    ctx.term()
    return 0

