"""Structured outputs on the scheduler's side: each constrained request's grammar and matcher.

The grammar state lives in the engine core, never in the runner. A constrained request's
grammar compiles off-thread (`GrammarCompiler`); until it is ready the request waits and is
not scheduled, without holding up the others (`Request.awaiting_grammar`); a compile error
fails it alone. The scheduler advances a request's matcher with each token it receives
(`Scheduler.update`). Once batch N's tokens are in, `fill_token_bitmask` writes the rows of
batch N+1, whose forward is already queued on the GPU; the runner then queues its sampling.

The backend is built from the tokenizer at the first constrained request (`backend_factory`):
engines that never see one load no grammar library.

With `workers` > 0 the matchers live in grammar worker processes (sched/grammar_workers.py),
started at the first constrained request: the scheduler's accepts are queued, and each
constrained step's accepts and bitmask rows run in all the workers at once. The core still
compiles every grammar itself (cached), for the readiness and the one-line compile error of
each request; a request is ready once its grammar compiled here and its worker is up.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from slipstream.sampling.grammar.backend import GrammarBackend
from slipstream.sampling.grammar.bitmask import fill_all_allowed, forbid_tokens
from slipstream.sampling.grammar.compiler import GrammarCompiler
from slipstream.sampling.grammar.matcher import fill_bitmasks
from slipstream.sampling.grammar.worker_pool import GrammarWorkerPool, GrammarWorkerSpec
from slipstream.sampling.structured import one_line
from slipstream.sched.grammar_workers import RemoteMatcher, WorkerMatchers
from slipstream.sched.request import Request

__all__ = ["StructuredOutputs", "StructuredOutputsStats"]


@dataclass
class StructuredOutputsStats:
    """What `EngineCore.stats` reports (the server's /metrics names): constrained_requests:
    requests with structured outputs received; grammar_compiled / grammar_compile_failed:
    compiles that succeeded / failed; grammar_compile_seconds: their time on the compile
    threads; grammar_cache_hits: requests whose grammar was cached (or compiling already);
    grammar_cpu_seconds: the step loop's time filling token bitmasks."""
    constrained_requests: int = 0
    grammar_compiled: int = 0
    grammar_compile_failed: int = 0
    grammar_compile_seconds: float = 0.0
    grammar_cache_hits: int = 0
    grammar_cpu_seconds: float = 0.0


class StructuredOutputs:
    """The grammar compiler of one engine core, built on first use, and its requests."""

    def __init__(self, backend_factory: Callable[[], GrammarBackend], workers: int = 0,
                 worker_spec: Callable[[], GrammarWorkerSpec] | None = None) -> None:
        """workers: grammar worker processes (0: the matchers run in this process);
        worker_spec: what they build their backend from (called at the first request)."""
        if workers and worker_spec is None:
            raise ValueError("grammar workers need a worker_spec")
        self._backend_factory = backend_factory
        self.num_workers = workers
        self._worker_spec = worker_spec
        self.workers: WorkerMatchers | None = None
        self._remote: dict[Request, RemoteMatcher] = {}  # compiling, with a worker
        self.compiler: GrammarCompiler | None = None
        self._backend_error: str | None = None
        self.compiling: list[Request] = []
        self.num_requests = 0
        self.grammar_cpu_s = 0.0

    def submit(self, req: Request) -> str | None:
        """Start compiling `req`'s grammar; the one-line reason when structured outputs are not
        available on this engine (the request then fails alone)."""
        if self.compiler is None and self._backend_error is None:
            try:
                self.compiler = GrammarCompiler(self._backend_factory())
            except Exception as e:  # noqa: BLE001 - no tokenizer, no library: this request fails
                self._backend_error = f"structured outputs are unavailable: {one_line(e)}"
        if self.compiler is None:
            return self._backend_error
        self.num_requests += 1
        req.grammar = self.compiler.submit(req.params.structured_outputs)
        if self.num_workers:
            if self.workers is None:
                spec = self._worker_spec()
                self.workers = WorkerMatchers(GrammarWorkerPool(spec, self.num_workers), spec.stop_token_ids)
            self._remote[req] = self.workers.submit(req)
        self.compiling.append(req)
        return None

    def poll(self) -> list[tuple[Request, str]]:
        """Give a matcher to every request whose grammar is ready; returns (request, error) of
        those whose compile failed. Never blocks."""
        failed, still = [], []
        for req in self.compiling:
            remote = self._remote.get(req)
            if req.finished:
                self._remote.pop(req, None)
                continue
            if not req.grammar.ready() or (remote is not None and not self.workers.ready(remote)):
                still.append(req)
            elif req.grammar.error is not None or (remote is not None and remote.worker.error):
                failed.append((req, req.grammar.error or remote.worker.error))
                self._remote.pop(req, None)
            elif remote is not None:
                req.matcher = self._remote.pop(req)
            else:
                req.matcher = self.compiler.new_matcher(req.grammar)
        self.compiling = still
        if self.workers is not None:
            failed += self.workers.take_failed()
        return failed

    def fill_token_bitmask(self, sampled: list[Request], bitmask: torch.Tensor,
                           suppress: Sequence[tuple[int, Sequence[int]]] = ()) -> None:
        """Every row of `bitmask` (its contents on entry are stale): row j from the matcher of
        `sampled[j]` for the constrained requests still running, the other rows (free requests,
        padding past `sampled`) all allowed; then the batch's min_tokens suppression (`suppress`:
        (row, stop token ids), ScheduledBatch.suppress), which a constrained batch applies here
        rather than on its logits.  The grammar wins over min_tokens: a constrained row whose
        grammar allows nothing but stop tokens keeps them, so the request ends "stop" instead
        of drawing from an empty distribution."""
        start = time.perf_counter()
        if self.workers is not None:
            rows = self.workers.fill(sampled, bitmask)
        else:
            rows = [j for j, req in enumerate(sampled) if req.matcher is not None and not req.finished]
            if rows:
                fill_bitmasks([sampled[j].matcher for j in rows], bitmask, rows)
        if len(rows) < bitmask.shape[0]:
            constrained = set(rows)
            fill_all_allowed(bitmask, [j for j in range(bitmask.shape[0]) if j not in constrained])
        for j, stop_ids in suppress:
            forbid_tokens(bitmask, j, stop_ids, keep_if_only=sampled[j].matcher is not None)
        self.grammar_cpu_s += time.perf_counter() - start

    def stats(self) -> StructuredOutputsStats:
        stats = StructuredOutputsStats(constrained_requests=self.num_requests,
                                       grammar_cpu_seconds=self.grammar_cpu_s)
        if self.compiler is not None:
            c = self.compiler.stats
            stats.grammar_compiled, stats.grammar_compile_failed = c.compiled, c.failed
            stats.grammar_compile_seconds, stats.grammar_cache_hits = c.total_compile_s, c.cache_hits
        return stats

    @property
    def worker_pids(self) -> list[int]:
        """The grammar worker processes started and not stopped."""
        return self.workers.pool.pids if self.workers is not None else []

    def close(self) -> None:
        if self.workers is not None:
            self.workers.pool.close()
        if self.compiler is not None:
            self.compiler.close()
