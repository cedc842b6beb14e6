"""A grammar worker process: the matchers of the constrained requests the core assigned to it.

Per constrained step the core sends one `Step`; the worker forgets the requests that ended,
advances each of its matchers past the tokens it sampled since the last step, writes the
next-token rows into the shared-memory bitmask and answers `StepDone`. The workers of an
engine run these in parallel, each over its share of the rows: a matcher's token accept is
serial Python-held work (tens of microseconds a token inside a JSON string), which threads in
one process cannot spread. A request's grammar compiles on the worker's own thread as soon as
the request arrives (`AddGrammar`), so a step rarely waits for one.

The worker exits when its pipe closes: the core closed it, or the core's process died.
"""
from __future__ import annotations

import json
import os
import sys
from multiprocessing import resource_tracker, shared_memory
from multiprocessing.connection import Connection

import msgspec
import numpy as np
import torch

from slipstream.sampling.grammar.backend import create_grammar_backend
from slipstream.sampling.grammar.bitmask import fill_all_allowed
from slipstream.sampling.grammar.compiler import GrammarCompiler, GrammarHandle
from slipstream.sampling.grammar.matcher import GrammarMatcher, fill_bitmasks
from slipstream.sampling.grammar.worker_messages import (
    AddGrammar,
    Ready,
    Step,
    StepDone,
    ToWorker,
)
from slipstream.sampling.structured import GrammarKey, one_line

__all__ = ["GrammarWorkerState", "worker_main"]


def _one_line(error: BaseException) -> str:
    return one_line(error) or type(error).__name__


class _SharedBitmask:
    """The core's shared-memory bitmask, attached by name (again when the core grows it)."""

    def __init__(self) -> None:
        self.name = ""
        self.shm: shared_memory.SharedMemory | None = None
        self.tensor: torch.Tensor | None = None

    def get(self, name: str, rows: int, words: int) -> torch.Tensor:
        if name != self.name or self.tensor is None or tuple(self.tensor.shape) != (rows, words):
            self.close()
            self.shm = shared_memory.SharedMemory(name=name)
            # the core created it and unlinks it; this process's resource tracker must not
            # (Python 3.11 registers a segment with the tracker of every process that opens it)
            resource_tracker.unregister(self.shm._name, "shared_memory")
            array = np.ndarray((rows, words), dtype=np.int32, buffer=self.shm.buf)
            self.tensor, self.name = torch.from_numpy(array), name
        return self.tensor

    def close(self) -> None:
        self.tensor, self.name = None, ""
        if self.shm is not None:
            try:
                self.shm.close()
            except BufferError:  # a view still alive: the mapping goes with the process
                pass
            self.shm = None


class GrammarWorkerState:
    """What one worker holds: its requests' compiles and matchers. `step` does one `Step`
    on a given bitmask (the process loop passes the shared one; tests, any tensor)."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.handles: dict[int, GrammarHandle] = {}
        self.matchers: dict[int, GrammarMatcher] = {}
        self.failed: set[int] = set()

    def add(self, msg: AddGrammar) -> None:
        key = GrammarKey(msg.kind, msg.spec, msg.fixed_whitespace)
        self.handles[msg.grammar_id] = self.compiler.submit_key(key)

    def _matcher(self, gid: int, errors: list[tuple[int, str]]) -> GrammarMatcher | None:
        if gid in self.failed:
            return None
        matcher = self.matchers.get(gid)
        if matcher is not None:
            return matcher
        handle = self.handles.pop(gid, None)
        try:
            if handle is None:
                raise ValueError(f"grammar worker {os.getpid()} does not know grammar id {gid}")
            matcher = self.matchers[gid] = self.compiler.new_matcher(handle)  # waits for its compile
        except Exception as e:  # noqa: BLE001 - one request's grammar fails that request alone
            errors.append((gid, _one_line(e)))
            self.failed.add(gid)
            return None
        return matcher

    def step(self, msg: Step, bitmask: torch.Tensor) -> StepDone:
        errors: list[tuple[int, str]] = []
        for gid in msg.finished:
            self.handles.pop(gid, None)
            self.matchers.pop(gid, None)
            self.failed.discard(gid)
        for gid, tokens in msg.accepts:
            matcher = self._matcher(gid, errors)
            if matcher is None:
                continue
            count = matcher.accept_many(tokens)
            if count < len(tokens):
                error = f"the sampled token {tokens[count]} does not follow the request's grammar"
                errors.append((gid, error))
                self.failed.add(gid)
        live, rows, free = [], [], []
        for gid, row in msg.fills:
            matcher = self._matcher(gid, errors)
            if matcher is None:
                free.append(row)
            else:
                live.append(matcher)
                rows.append(row)
        if live:
            fill_bitmasks(live, bitmask, rows)
        if free:
            fill_all_allowed(bitmask, free)
        return StepDone(errors)


def worker_main(conn: Connection, spec_file: str) -> None:
    """The process's loop: the backend from `spec_file` (worker_pool.write_spec), `Ready`, then
    one message at a time until the pipe closes."""
    encoder = msgspec.msgpack.Encoder()
    try:
        from transformers import AutoTokenizer
        with open(spec_file) as f:
            spec = json.load(f)
        hf_tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
        backend = create_grammar_backend(spec["backend"], hf_tokenizer, spec["vocab_size"],
                                         tuple(spec["stop_token_ids"]), batch_threads=spec["batch_threads"])
    except Exception as e:  # noqa: BLE001 - reported to the core, which fails the requests
        conn.send_bytes(encoder.encode(Ready(os.getpid(), _one_line(e))))
        return
    del hf_tokenizer
    compiler = GrammarCompiler(backend)
    state = GrammarWorkerState(compiler)
    shared = _SharedBitmask()
    decoder = msgspec.msgpack.Decoder(ToWorker)
    try:
        conn.send_bytes(encoder.encode(Ready(os.getpid())))
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                break
            msg = decoder.decode(data)
            if isinstance(msg, AddGrammar):
                state.add(msg)
            else:
                bitmask = shared.get(msg.bitmask_name, msg.bitmask_rows, msg.bitmask_words)
                conn.send_bytes(encoder.encode(state.step(msg, bitmask)))
    except OSError:  # the core closed the pipe while this worker was answering
        pass
    finally:
        shared.close()
        compiler.close()


if __name__ == "__main__":
    worker_main(Connection(int(sys.argv[1])), sys.argv[2])
    os._exit(0)  # nothing left to flush; the interpreter's teardown of torch takes seconds
