"""`GrammarWorkerPool`: the engine core's side of its grammar worker processes (worker_main.py).

The constrained requests are shared out among N spawned processes at arrival (the least
loaded live worker takes the next one). A constrained step sends each worker that has work one
`Step` (msgpack bytes over its pipe) and waits for all of them: they accept their requests'
new tokens and write their rows of one shared-memory int32 bitmask side by side, so a step's
grammar work takes about 1/N of its serial time. The core then copies the filled rows into the
slot's pinned bitmask (a 1.5 MB memcpy at 256 rows of a 150k vocabulary, about 0.1 ms).

Processes start when the first constrained request arrives, are daemons (they end with the
core's process at exit) and exit on their own when their pipe closes (the core's process
died). A worker that dies fails its requests with one line; the next request that lands on
its slot starts a fresh one. A worker that cannot build its backend (no library) reports it
once and every request assigned to it fails with that reason.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np
import torch

from slipstream.sampling.grammar.worker_messages import (
    AddGrammar,
    FromWorker,
    Ready,
    Step,
    StepDone,
)
from slipstream.sampling.structured import GrammarKey

__all__ = ["GrammarWorker", "GrammarWorkerPool", "GrammarWorkerSpec"]

_POLL_S = 0.5  # how often a step's wait checks that the worker it waits on is alive


@dataclass(frozen=True)
class GrammarWorkerSpec:
    """What a worker builds its backend from (written once to files a starting worker reads:
    `write_spec`): the backend's name, the transformers tokenizer, the model's vocabulary size
    (logits width) and its stop token ids."""
    backend: str
    hf_tokenizer: Any
    vocab_size: int
    stop_token_ids: tuple[int, ...]


def write_spec(folder: str, spec: GrammarWorkerSpec, batch_threads: int) -> str:
    """`spec` as files in `folder` (the tokenizer's `save_pretrained` files, the rest JSON; no
    pickled objects cross the process boundary); returns the JSON file's path."""
    spec.hf_tokenizer.save_pretrained(os.path.join(folder, "tokenizer"))
    path = os.path.join(folder, "spec.json")
    with open(path, "w") as f:
        json.dump({"backend": spec.backend, "tokenizer": os.path.join(folder, "tokenizer"),
                   "vocab_size": spec.vocab_size, "stop_token_ids": list(spec.stop_token_ids),
                   "batch_threads": batch_threads}, f)
    return path


class GrammarWorker:
    """One worker process: its pipe, whether it is up, and why it is gone (`error`).

    A fresh interpreter (`python -m slipstream.sampling.grammar.worker_main FD SPEC_FILE`), not
    a fork (the core holds threads and CUDA) nor multiprocessing's spawn (which re-imports the
    user's main script); the pipe is a socket pair, its end inherited as FD. The backend's
    inputs are written once beside SPEC_FILE, the tokenizer as its own files (a pipe would
    block the core until the worker has imported torch)."""

    def __init__(self, index: int, spec_file: str) -> None:
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "slipstream.sampling.grammar.worker_main", str(theirs.fileno()),
             spec_file], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()  # the worker's end lives in the worker only: its exit closes the pipe
        self.conn = Connection(ours.detach())
        self.index = index
        self.ready = False
        self.error: str | None = None
        self.restartable = True  # False: it could not build its backend, a new one would not either
        self.num_requests = 0  # requests assigned and not ended
        self.ended: list[int] = []  # grammar ids of ended requests the worker is yet to hear of

    def alive(self) -> bool:
        return self.process.poll() is None

    def died(self) -> None:
        if self.error is None:
            try:
                self.process.wait(0.2)
            except subprocess.TimeoutExpired:
                pass
            self.error = (f"the structured-outputs worker process {self.index} (pid "
                          f"{self.process.pid}) died (exit code {self.process.returncode}); the "
                          f"request's grammar state is lost")

    def close(self) -> None:
        self.conn.close()


def _stop(workers: list[GrammarWorker], shm: list[shared_memory.SharedMemory], folder: str) -> None:
    """Closes the pipes (a worker exits at once), then makes sure each process is gone;
    unlinks the shared bitmask."""
    for w in workers:
        w.close()
    for w in workers:
        for stop in (None, w.process.terminate, w.process.kill):
            if stop is not None:
                stop()
            try:
                w.process.wait(3)
                break
            except subprocess.TimeoutExpired:
                continue
    workers.clear()
    for segment in shm:
        _drop(segment)
    shm.clear()
    shutil.rmtree(folder, ignore_errors=True)


def _drop(segment: shared_memory.SharedMemory) -> None:
    try:
        segment.close()
    except BufferError:  # a view still alive: the mapping goes with it
        pass
    try:
        segment.unlink()
    except FileNotFoundError:
        pass


class GrammarWorkerPool:
    """`num_workers` worker processes for one engine core, started at the first `assign`."""

    def __init__(self, spec: GrammarWorkerSpec, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"a grammar worker pool needs num_workers >= 1, got {num_workers}")
        self.spec = spec
        self.num_workers = num_workers
        batch_threads = max(1, ((os.cpu_count() or 1) - 1) // num_workers)
        self._folder = tempfile.mkdtemp(prefix="slipstream-grammar-")
        self._spec_file = write_spec(self._folder, spec, batch_threads)
        self.slots: list[GrammarWorker | None] = [None] * num_workers
        self._live: list[GrammarWorker] = []  # every process started, for the finalizer
        self._shm: list[shared_memory.SharedMemory] = []
        self._bitmask: torch.Tensor | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromWorker)
        self._finalizer = weakref.finalize(self, _stop, self._live, self._shm, self._folder)

    # -- requests ---------------------------------------------------------------------
    def assign(self, grammar_id: int, key: GrammarKey) -> GrammarWorker:
        """The worker that owns request `grammar_id` from now on; it starts compiling `key`."""
        index = min(range(self.num_workers), key=lambda i: self._load(i))
        worker = self.slots[index]
        if worker is not None and worker.error is None and not worker.alive():
            worker.died()
        if worker is None or (worker.error is not None and worker.restartable):  # dead: a fresh one
            worker = self.slots[index] = GrammarWorker(index, self._spec_file)
            self._live.append(worker)
        worker.num_requests += 1
        self._send(worker, AddGrammar(grammar_id, key.kind, key.spec, key.fixed_whitespace))
        return worker

    def _load(self, index: int) -> tuple[int, int]:
        worker = self.slots[index]
        if worker is None:
            return (0, index)
        if worker.error is not None:
            # a dead one is replaced by a fresh process with nothing to do; one whose backend
            # failed takes requests only when every slot is like it
            return (0 if worker.restartable else 1 << 30, index)
        return (worker.num_requests, index)

    def release(self, worker: GrammarWorker) -> None:
        """A request of `worker` ended (the next `Step` tells the worker)."""
        worker.num_requests -= 1

    def is_ready(self, worker: GrammarWorker) -> bool:
        """The worker is up or gone (then `worker.error` says why); never blocks."""
        if not worker.ready and worker.error is None:
            self._drain(worker, wait=False)
        return worker.ready or worker.error is not None

    # -- steps ------------------------------------------------------------------------
    def bitmask(self, rows: int, words: int) -> torch.Tensor:
        """The shared bitmask, at least `rows` x `words` (grown, never shrunk)."""
        if self._bitmask is None or self._bitmask.shape[0] < rows or self._bitmask.shape[1] != words:
            rows = max(rows, self._bitmask.shape[0] if self._bitmask is not None else 0)
            segment = shared_memory.SharedMemory(create=True, size=rows * words * 4)
            self._bitmask = torch.from_numpy(np.ndarray((rows, words), dtype=np.int32,
                                                        buffer=segment.buf))
            for old in self._shm:  # the workers attach the new one at their next step
                _drop(old)
            self._shm[:] = [segment]
        return self._bitmask

    def step(self, messages: Mapping[GrammarWorker, Step]) -> dict[int, str]:
        """Sends every worker its step and waits for all; returns the per-request errors
        (grammar id -> one line). A worker that died is marked (`error`) and sends nothing."""
        name = self._shm[-1].name if self._shm else ""
        rows, words = self._bitmask.shape if self._bitmask is not None else (0, 0)
        sent = []
        for worker, msg in messages.items():
            if worker.error is not None:
                continue
            msg.bitmask_name, msg.bitmask_rows, msg.bitmask_words = name, rows, words
            if self._send(worker, msg):
                sent.append(worker)
        errors: dict[int, str] = {}
        for worker in sent:
            done = self._drain(worker, wait=True)
            if done is not None:
                errors.update(done.errors)
        return errors

    def _send(self, worker: GrammarWorker, msg: Any) -> bool:
        if worker.error is not None:
            return False
        try:
            worker.conn.send_bytes(self._encoder.encode(msg))
        except OSError:
            worker.died()
            return False
        return True

    def _drain(self, worker: GrammarWorker, *, wait: bool) -> StepDone | None:
        """Reads what the worker sent: without `wait`, what is there; with it, up to its
        `StepDone` (None if the worker died first)."""
        while worker.error is None:
            try:
                if not worker.conn.poll(_POLL_S if wait else 0):
                    if wait and not worker.alive():
                        worker.died()
                    elif wait:
                        continue
                    return None
                msg = self._decoder.decode(worker.conn.recv_bytes())
            except (EOFError, OSError):
                worker.died()
                return None
            if isinstance(msg, Ready):
                worker.ready = msg.error is None
                if msg.error is not None:
                    worker.restartable = False
                    worker.error = f"structured outputs are unavailable: {msg.error}"
            elif wait:
                return msg
        return None

    @property
    def pids(self) -> list[int]:
        """The processes started and not stopped (tests check none outlives the engine)."""
        return [w.process.pid for w in self._live]

    def close(self) -> None:
        self._bitmask = None
        self._finalizer()
