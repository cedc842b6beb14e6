"""The overlap loop, in one function (`StepLoop.step`)."""
from __future__ import annotations

import time

from slipstream.core.tracing import Timeline
from slipstream.executor import Executor
from slipstream.sched.in_flight import InFlight
from slipstream.sched.request import Request
from slipstream.sched.scheduler import Scheduler


class StepLoop:
    """Each step schedules batch N+1 and launches it, then, once `depth` batches are in
    flight, blocks on the oldest (N) and hands its tokens to the scheduler.  The GPU
    computes N while the CPU schedules and builds N+1.  depth=1 is the synchronous
    baseline: launch, wait, process, in turn.

    `in_flight` (the scheduler's, shared with the block pool) is the one registry of
    launched batches: a batch enters it once the runner's launch returned.

    Structured outputs: a batch with constrained rows launches its forward only.  Its token
    bitmask needs the tokens of every older batch, so its fill starts (`_sample_deferred`)
    once it is the only batch in flight: right after its launch in sync mode, after batch N
    was processed in async mode.  The matchers fill their rows on a background thread while
    this one schedules N+2; the sampling of N+1 is queued (`_finish_deferred`) before N+2
    is launched, or before any wait.  Batches without constrained rows take the usual path."""

    def __init__(self, scheduler: Scheduler, runner: Executor, depth: int,
                 timeline: Timeline | None = None) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.depth = depth
        self.timeline = timeline
        self.in_flight: InFlight = scheduler.in_flight
        self.num_batches = 0
        self.stuck = False  # the last step could place no request and had nothing in flight
        self.deferred = None  # the launched batch whose sampling waits for its token bitmask
        self.filling = None  # (launched batch, its BitmaskFill, start time): sampling not queued yet

    def step(self) -> list[Request]:
        """One turn; returns the requests that got tokens (or prompt logprobs) or ended."""
        tl = self.timeline
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        t1 = time.perf_counter()
        self._finish_deferred()
        if batch is not None:
            t2 = time.perf_counter()
            launched = self.runner.launch(batch)
            self.in_flight.launched(batch.batch_id, launched, batch.blocks)
            self.num_batches += 1
            if batch.num_constrained:
                self.deferred = launched
            if tl:
                tl.batch(batch)
                tl.cpu("schedule", t0, t1, batch.batch_id)
                tl.cpu("launch", t2, time.perf_counter(), batch.batch_id)
            self._sample_deferred()
        self.stuck = batch is None and not self.in_flight and self.scheduler.has_unfinished()
        if self.scheduler.drafting:
            # speculative decoding: the next batch's inputs depend on this one's accepted
            # drafts, so the step completes every batch in flight (the synchronous loop)
            touched = []
            while self.in_flight:
                touched += self._complete_oldest()
            return touched
        if not self.in_flight or (batch is not None and len(self.in_flight) < self.depth):
            return []
        return self._complete_oldest()

    def _complete_oldest(self) -> list[Request]:
        """Block on the oldest batch in flight and hand its tokens to the scheduler."""
        tl = self.timeline
        self._finish_deferred()
        done = self.in_flight.oldest()
        t2 = time.perf_counter()
        result = self.runner.wait(done)
        t3 = time.perf_counter()
        touched = self.scheduler.update(done.batch, result)
        self.in_flight.completed(done.batch.batch_id)
        if tl:
            tl.cpu("wait", t2, t3, done.batch.batch_id)
            tl.cpu("process", t3, time.perf_counter(), done.batch.batch_id)
            if getattr(done, "gpu_times", None):
                tl.gpu(done.batch.batch_id, done.gpu_times)
        self._sample_deferred()
        return touched

    def _sample_deferred(self) -> None:
        """Start filling the deferred batch's token bitmask once the tokens of every older
        batch are in (the scheduler's matchers write the runner's pinned bitmask)."""
        if self.deferred is None or len(self.in_flight) != 1:
            return
        launched, self.deferred = self.deferred, None
        t0 = time.perf_counter()
        bitmask = self.runner.token_bitmask(launched)
        fill = self.scheduler.structured_outputs.start_fill(launched.batch.sampled, bitmask,
                                                            launched.batch.suppress)
        self.filling = (launched, fill, t0, time.perf_counter())

    def _finish_deferred(self) -> None:
        """Once its bitmask is complete, queue the filling batch's sampling (the runner
        uploads the bitmask and samples)."""
        if self.filling is None:
            return
        launched, fill, t0, t1 = self.filling
        self.filling = None
        t2 = time.perf_counter()
        fill.wait()
        self.runner.finish_launch(launched)
        if self.timeline:  # the loop's own time on it: the fill's start, then its wait and launch
            self.timeline.cpu("grammar", t0, t1, launched.batch.batch_id)
            self.timeline.cpu("grammar", t2, time.perf_counter(), launched.batch.batch_id)
