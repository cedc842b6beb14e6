"""Executors: what runs a scheduled batch on the model, between the engine core and the runners.

An executor has the runner's face (`launch(batch) -> handle`, `wait(handle) -> BatchResult`,
`num_blocks`, `close()`), so the step loop drives either the same way:

* one rank: the `ModelRunner` itself, in the core's process (today's path, nothing between);
* `tensor_parallel_size` N > 1: `MultiprocExecutor` (multiproc.py), one worker process per
  rank (worker.py), each a ModelRunner on its own device in one torch.distributed group.
  The core builds each step's inputs once and sends them to every rank (messages.py).

A Ray executor would replace the worker processes and the transport, not the core.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from slipstream.runner.model_runner import Launched
    from slipstream.sched.batch import BatchResult, ScheduledBatch


class Executor(Protocol):
    """What the step loop drives: ModelRunner (one rank) and MultiprocExecutor have it."""
    num_blocks: int  # KV blocks per rank (the smallest over the ranks)

    def launch(self, batch: ScheduledBatch) -> Launched:
        """Start a batch; returns at once."""

    def wait(self, launched: Launched) -> BatchResult:
        """Block until that batch's tokens are on the host."""
