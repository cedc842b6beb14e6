"""The constrained requests' matchers in grammar worker processes (`--structured-outputs-workers`).

The scheduler keeps calling `req.matcher.accept(token)` and reading `is_terminated` as it does
with an in-process matcher; here the matcher is a `RemoteMatcher`, which queues the token for
the worker's next step and answers at once. It can: the token was drawn under the request's
bitmask, so the grammar accepts it, and it terminates the grammar exactly when it is one of the
stop tokens (the only tokens a grammar ends on, allowed only where it is complete). A token the
worker finds rejected anyway (a sampler bug) fails the request at the next step.

`fill` is one constrained step: each worker gets the tokens its requests sampled since its last
step, the rows of the batch to fill and the requests that ended; all work at once; then the
rows they wrote into the shared bitmask are copied into the slot's pinned bitmask.
Preemption needs nothing here: a preempted request keeps its tokens, so its matcher too.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from slipstream.sampling.grammar.worker_messages import Step
from slipstream.sampling.grammar.worker_pool import GrammarWorker, GrammarWorkerPool
from slipstream.sched.request import Request

__all__ = ["RemoteMatcher", "WorkerMatchers"]


class RemoteMatcher:
    """The core's stand-in for a matcher living in grammar worker `worker`."""

    __slots__ = ("error", "grammar_id", "pending", "stop_token_ids", "terminated", "worker")

    def __init__(self, grammar_id: int, worker: GrammarWorker, stop_token_ids: frozenset[int]):
        self.grammar_id = grammar_id
        self.worker = worker
        self.stop_token_ids = stop_token_ids
        self.pending: list[int] = []  # accepted here, not yet sent to the worker
        self.terminated = False
        self.error: str | None = None  # the worker failed the request (reported by `poll`)

    def accept(self, token_id: int) -> bool:
        self.pending.append(token_id)
        self.terminated = token_id in self.stop_token_ids
        return True

    @property
    def is_terminated(self) -> bool:
        return self.terminated


class WorkerMatchers:
    """The requests whose matchers live in `pool`'s workers."""

    def __init__(self, pool: GrammarWorkerPool, stop_token_ids: Iterable[int]) -> None:
        self.pool = pool
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.requests: dict[int, tuple[Request, RemoteMatcher]] = {}
        self._next_id = 0
        self._failed: list[tuple[Request, str]] = []

    def submit(self, req: Request) -> RemoteMatcher:
        """Assign `req` to a worker, which starts compiling its grammar; its matcher (set on
        the request by the caller once `ready`)."""
        gid, self._next_id = self._next_id, self._next_id + 1
        worker = self.pool.assign(gid, req.params.structured_outputs.key())
        remote = RemoteMatcher(gid, worker, self.stop_token_ids)
        self.requests[gid] = (req, remote)
        return remote

    def ready(self, remote: RemoteMatcher) -> bool:
        """Its worker is up, or gone (then `remote.worker.error` says why)."""
        return self.pool.is_ready(remote.worker)

    def take_failed(self) -> list[tuple[Request, str]]:
        """Requests the workers failed since the last call (still to be ended)."""
        failed, self._failed = self._failed, []
        return [(req, error) for req, error in failed if not req.finished]

    def fill(self, sampled: Sequence[Request], bitmask: torch.Tensor) -> list[int]:
        """Rows of `bitmask` filled by the workers (the constrained rows whose request is alive);
        the caller fills the others."""
        messages: dict[GrammarWorker, Step] = {}

        def message(worker: GrammarWorker) -> Step:
            msg = messages.get(worker)
            if msg is None:
                msg = messages[worker] = Step([], [], [], "", 0, 0)
            return msg

        for gid, (req, remote) in list(self.requests.items()):
            if req.finished:
                del self.requests[gid]
                self.pool.release(remote.worker)
                # (a worker still starting hears of it at its first step: no step waits for a start)
                remote.worker.ended.append(gid)
            elif remote.pending and remote.error is None:
                message(remote.worker).accepts.append((gid, remote.pending))
                remote.pending = []
        for worker in self.pool.slots:
            if worker is not None and worker.ended and worker.ready and worker.error is None:
                message(worker).finished.extend(worker.ended)
                worker.ended = []
        shared = self.pool.bitmask(bitmask.shape[0], bitmask.shape[1])
        rows: list[tuple[int, RemoteMatcher]] = []
        for j, req in enumerate(sampled):
            remote = req.matcher
            if isinstance(remote, RemoteMatcher) and not req.finished and remote.error is None:
                message(remote.worker).fills.append((remote.grammar_id, j))
                rows.append((j, remote))
        errors = self.pool.step(messages) if messages else {}
        for gid, error in errors.items():
            self._fail(gid, error)
        for worker in messages:
            if worker.error is not None:  # it died: every request it held fails
                for gid, (_, remote) in self.requests.items():
                    if remote.worker is worker:
                        self._fail(gid, worker.error)
        filled = [j for j, remote in rows if remote.error is None or remote.grammar_id in errors]
        if filled:
            n = max(filled) + 1
            # numpy's copy: one thread, ~0.1 ms for 5 MB; torch's copy_ goes through its
            # intra-op thread pool, which on a loaded machine took 20 ms for the same
            np.copyto(bitmask[:n].numpy(), shared[:n].numpy())
        return filled

    def _fail(self, gid: int, error: str) -> None:
        entry = self.requests.get(gid)
        if entry is not None and entry[1].error is None:
            entry[1].error = error
            self._failed.append((entry[0], error))
