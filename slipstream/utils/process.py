"""Process-level helpers shared by the engine core and the tensor-parallel workers: the
sockets of their channels and the garbage collector's policy around an engine's build."""
from __future__ import annotations

import atexit
import contextlib
import gc

import zmq


def new_socket(ctx: zmq.Context, kind: int, linger_ms: int = 0) -> zmq.Socket:
    """A socket of the core's channels: no high-water mark (a message is never dropped or
    blocks its sender), and `linger_ms` to deliver what is queued at close."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


@contextlib.contextmanager
def collector_paused():
    """The garbage collector off while an engine is built, on again after (if it was on).

    The build allocates hundreds of thousands of objects (modules' graphs, CUDA graph nodes'
    ctypes buffers), nearly all kept for the process's life or freed by their reference
    counts; yet each allocation burst triggers collections, and a full one scans the whole
    startup heap (benchmarks/notes/benchmarks.md, "Engine start"). Cycles made meanwhile wait for the
    next collection."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def freeze_gc() -> None:
    """Take everything alive now (model, CUDA graphs, imported modules: hundreds of thousands
    of objects) out of the garbage collector's reach, for a process that keeps one engine.

    Python's full collections scan every tracked object. While requests arrive their lists
    trigger such collections, and scanning the startup heap with them stalls the CPU that
    feeds the GPU (a full collection of 86 ms while small-256's prompts arrived;
    benchmarks/notes/benchmarks.md). Frozen objects are never
    scanned again, and not collected until the process exits (they are thawed then, so
    extension modules see their objects released). Call it once the engine is built and
    warmed up, in processes that run one engine (the CLI, the core process, the bench do).
    """
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often this is called
    atexit.register(gc.unfreeze)
