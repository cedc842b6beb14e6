"""`GrammarCompiler`: compiles requests' StructuredOutputsParams on worker threads, with an
LRU cache keyed by `StructuredOutputsParams.key()`.

`submit` never blocks: it returns a `GrammarHandle` whose `ready()` the scheduler polls, so a
request waits while its grammar compiles and every other request keeps running (a JSON
schema takes tens of milliseconds to seconds). Requests with the same key share one compile,
in flight or done. A failed compile is cached too (the same text fails the same way); its
handle's `error` is a one-line message such as ``invalid JSON schema: ...``.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from slipstream.sampling.grammar.backend import GrammarBackend
from slipstream.sampling.grammar.matcher import GrammarMatcher
from slipstream.sampling.structured import GrammarKey, StructuredOutputsParams

__all__ = ["GrammarCompiler", "GrammarCompilerStats", "GrammarHandle"]


@dataclass
class GrammarCompilerStats:
    """compiled: compiles that succeeded; failed: compiles that raised; cache_hits: submits
    served by a cached (or in-flight) compile; seconds are wall time on the worker thread."""
    compiled: int = 0
    failed: int = 0
    cache_hits: int = 0
    total_compile_s: float = 0.0
    last_compile_s: float = 0.0


class GrammarHandle:
    """A compile in flight or done: poll `ready()`, then `result()` or `error`."""

    __slots__ = ("_future", "key")

    def __init__(self, key: GrammarKey, future: Future):
        self.key = key
        self._future = future

    def ready(self) -> bool:
        """The compile has finished, successfully or not (never blocks)."""
        return self._future.done()

    @property
    def error(self) -> str | None:
        """The one-line compile error; None while compiling or after a success."""
        if not self._future.done():
            return None
        error = self._future.exception()
        return None if error is None else str(error)

    def result(self, timeout: float | None = None) -> Any:
        """The compiled grammar, waiting for it up to `timeout` seconds (None: no limit).
        A compile error raises ValueError; the time limit, TimeoutError."""
        return self._future.result(timeout)


class GrammarCompiler:
    """Compiles grammars for one backend on `max_workers` threads, keeping the last
    `cache_size` keys' results."""

    def __init__(self, backend: GrammarBackend, *, max_workers: int = 1, cache_size: int = 256):
        if max_workers < 1 or cache_size < 1:
            raise ValueError(f"GrammarCompiler needs max_workers >= 1 and cache_size >= 1, "
                             f"got {max_workers} and {cache_size}")
        self.backend = backend
        self.cache_size = cache_size
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._lock = threading.Lock()  # the cache and the stats: workers write the stats
        self._stats = GrammarCompilerStats()

    def submit(self, params: StructuredOutputsParams) -> GrammarHandle:
        """Starts compiling `params` (or finds it cached) and returns at once."""
        return self.submit_key(params.key())

    def submit_key(self, key: GrammarKey) -> GrammarHandle:
        """`submit` for a constraint's canonical key (what a grammar worker process receives)."""
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self._stats.cache_hits += 1
                return GrammarHandle(key, future)
            future = self._executor.submit(self._compile, key)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)  # a handle keeps an evicted compile alive
        return GrammarHandle(key, future)

    def _compile(self, key: GrammarKey) -> Any:
        start = time.perf_counter()
        try:
            compiled = self.backend.compile(key)
        except ValueError:
            self._record(start, succeeded=False)
            raise
        except BaseException:
            # not the grammar's fault (memory, a backend bug): the next submit tries again
            self._record(start, succeeded=False)
            with self._lock:
                self._cache.pop(key, None)
            raise
        self._record(start, succeeded=True)
        return compiled

    def _record(self, start: float, *, succeeded: bool) -> None:
        seconds = time.perf_counter() - start
        with self._lock:
            if succeeded:
                self._stats.compiled += 1
            else:
                self._stats.failed += 1
            self._stats.total_compile_s += seconds
            self._stats.last_compile_s = seconds

    def new_matcher(self, handle: GrammarHandle) -> GrammarMatcher:
        """A matcher at the start of `handle`'s grammar (waits if it is still compiling)."""
        return GrammarMatcher(self.backend, handle.result())

    @property
    def stats(self) -> GrammarCompilerStats:
        """A copy of the counters."""
        with self._lock:
            return replace(self._stats)

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)

    def close(self) -> None:
        """Stops the workers; compiles in flight finish first."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> GrammarCompiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
