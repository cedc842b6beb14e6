"""Compile a kernel sweep's launches in worker processes before timing them.

A sweep of Triton variants (tiles, stages, splits) at several row counts and shapes launches
a few hundred distinct kernels, each compiled on its first launch, one after another: ~2 s
each on a GPU host, longer than the timing itself. Here `jobs` spawned processes (each its
own CUDA context) run each launch once, so every kernel lands in Triton's on-disk cache;
the timing process then finds them there (a cache hit loads a cubin in milliseconds).
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import time
from collections.abc import Callable


def precompile(worker: Callable[..., int], tasks: list, jobs: int, *args) -> None:
    """worker(share, *args) -> launches run, in `jobs` processes, tasks dealt round-robin (so
    that each process builds a few of every shape's tensors). `worker` must be importable by
    name (a module-level function of the calling script)."""
    start = time.perf_counter()
    shares = [tasks[i::jobs] for i in range(jobs)]
    with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        done = sum(pool.map(worker, shares, *([a] * jobs for a in args)))
    print(f"compiled {done} launches in {jobs} processes: {time.perf_counter() - start:.0f} s", flush=True)
