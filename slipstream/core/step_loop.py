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
    bitmask needs the tokens of every older batch, so its sampling is queued
    (`_sample_deferred`) once it is the only batch in flight: right after its launch in sync
    mode, after batch N was processed in async mode (before N+2 is scheduled).  Batches
    without constrained rows take the usual path."""

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

    def step(self) -> list[Request]:
        """One turn; returns the requests that got tokens (or prompt logprobs) or ended."""
        tl = self.timeline
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        t1 = time.perf_counter()
        if batch is not None:
            launched = self.runner.launch(batch)
            self.in_flight.launched(batch.batch_id, launched, batch.blocks)
            self.num_batches += 1
            if batch.num_constrained:
                self.deferred = launched
            if tl:
                tl.batch(batch)
                tl.cpu("schedule", t0, t1, batch.batch_id)
                tl.cpu("launch", t1, time.perf_counter(), batch.batch_id)
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
        """Queue the deferred batch's sampling once the tokens of every older batch are in:
        the scheduler's matchers fill its token bitmask, the runner uploads it and samples."""
        if self.deferred is None or len(self.in_flight) != 1:
            return
        launched, self.deferred = self.deferred, None
        t0 = time.perf_counter()
        bitmask = self.runner.token_bitmask(launched)
        self.scheduler.structured_outputs.fill_token_bitmask(launched.batch.sampled, bitmask,
                                                             launched.batch.suppress)
        self.runner.finish_launch(launched)
        if self.timeline:
            self.timeline.cpu("grammar", t0, time.perf_counter(), launched.batch.batch_id)
