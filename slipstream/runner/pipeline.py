"""The three CUDA streams and their events; the same calls are no-ops on the CPU.

h2d copies a slot's inputs and records `h2d_done`; compute waits on it, runs the step
and records `compute_done`; d2h waits on that, copies the sampled tokens back and
records `d2h_done`; the CPU blocks on `d2h_done` only when it needs the tokens.
A wait blocks a stream, never the CPU.
"""
from __future__ import annotations

import contextlib
import time

import torch


class NullEvent:
    """Stands in for a CUDA event on the CPU, where every op has finished on return."""

    def __init__(self) -> None:
        self.time = 0.0

    def record(self, stream=None) -> None:
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class Streams:
    def __init__(self, device: torch.device, timing: bool = False) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.timing = timing
        if self.cuda:
            self.h2d = torch.cuda.Stream(device)
            self.compute = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)
        else:
            self.h2d = self.compute = self.d2h = None

    def event(self):
        if self.cuda:
            return torch.cuda.Event(enable_timing=self.timing)
        return NullEvent()

    def on(self, stream):
        """Issue work on `stream` (a no-op context on the CPU)."""
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def wait(self, stream, event) -> None:
        """Make `stream` wait for `event` without blocking the CPU."""
        if self.cuda:
            stream.wait_event(event)

    @contextlib.contextmanager
    def uploading(self, slot):
        """A step's uploads into `slot`: on the h2d stream, once the slot's previous step has
        read its inputs, between its h2d_start and h2d_done events."""
        with self.on(self.h2d):
            self.wait(self.h2d, slot.compute_done)
            slot.h2d_start.record()
            yield
            slot.h2d_done.record()

    @contextlib.contextmanager
    def computing(self, slot, uploaded=()):
        """A step's device work on `slot`: on the compute stream, once its uploads are in and
        the slot's previous tokens were copied out, between its compute_start and
        compute_done events; `uploaded` (tensors made on the h2d stream) is kept alive for it."""
        if self.cuda:
            for t in uploaded:
                t.record_stream(self.compute)
        with self.on(self.compute):
            self.wait(self.compute, slot.h2d_done)
            self.wait(self.compute, slot.d2h_done)
            slot.compute_start.record()
            yield
            slot.compute_done.record()

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
