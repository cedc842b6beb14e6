"""A per-batch timeline: CPU spans and the spans of the three GPU streams.

GPU active time is the union of the compute spans over the wall time.  The timeline
writes a Chrome / Perfetto trace (chrome://tracing, ui.perfetto.dev).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

LANES = ("cpu", "h2d", "compute", "d2h")


@dataclass
class Span:
    lane: str
    name: str
    start: float  # seconds, time.perf_counter clock
    end: float
    batch_id: int


@dataclass
class BatchStats:
    batch_id: int
    num_tokens: int
    num_samples: int
    context_tokens: int  # sum of seq_lens: KV read
    attention_pairs: float  # sum over tokens of the context they attend to
    # each row's cached tokens and new tokens: what a sliding-window layer reads (`windowed`)
    starts: np.ndarray | None = None
    num_new: np.ndarray | None = None
    # a speculative decoding step without a prompt chunk: every row samples, at most k + 1
    # tokens a row (its last token and its drafts), so more tokens than samples
    verify: bool = False

    def windowed(self, window: int) -> tuple[int, float]:
        """(KV positions read, attention pairs) of a layer whose queries attend to the last
        `window` keys: a row of `n` new tokens after `s` cached ones reads min(s + n, window - 1
        + n) keys (the first query's window and the new tokens), and its query at position p
        attends to min(p + 1, window)."""
        if self.starts is None:
            raise ValueError("batch stats without per-row starts cannot be windowed")
        s, n = self.starts.astype(np.float64), self.num_new.astype(np.float64)
        read = np.minimum(s + n, window - 1 + n)

        def pairs_up_to(m):  # sum over j = 1..m of min(j, window)
            inside = np.minimum(m, window)
            return inside * (inside + 1) / 2 + np.maximum(m - window, 0) * window
        return int(read.sum()), float((pairs_up_to(s + n) - pairs_up_to(s)).sum())


@dataclass
class Timeline:
    spans: list[Span] = field(default_factory=list)
    batches: list[BatchStats] = field(default_factory=list)

    def cpu(self, name: str, start: float, end: float, batch_id: int = -1) -> None:
        self.spans.append(Span("cpu", name, start, end, batch_id))

    def gpu(self, batch_id: int, times: dict[str, tuple[float, float]]) -> None:
        for lane, (start, end) in times.items():
            self.spans.append(Span(lane, lane, start, end, batch_id))

    def batch(self, batch) -> None:
        start, n = batch.start.astype("float64"), batch.num_new.astype("float64")
        spec = getattr(batch, "spec", None)
        verify = (spec is not None and len(batch.sampled) == batch.num_seqs and n.size > 0
                  and n.max() <= spec.k + 1)
        self.batches.append(BatchStats(
            batch.batch_id, int(n.sum()), len(batch.sampled), int((start + n).sum()),
            float((n * (start + (n + 1) / 2)).sum()), batch.start.copy(), batch.num_new.copy(), verify))

    def middle(self, num_batches: int) -> "Timeline":
        """The spans of `num_batches` batches from the middle of the run (small traces)."""
        ids = sorted({b.batch_id for b in self.batches})
        if len(ids) <= num_batches:
            return self
        lo = ids[(len(ids) - num_batches) // 2]
        keep = range(lo, lo + num_batches)
        return Timeline([s for s in self.spans if s.batch_id in keep],
                        [b for b in self.batches if b.batch_id in keep])

    def bounds(self) -> tuple[float, float]:
        return min(s.start for s in self.spans), max(s.end for s in self.spans)

    def busy(self, lane: str, start: float | None = None, end: float | None = None) -> float:
        """Seconds covered by the union of `lane`'s spans within [start, end]."""
        lo, hi = self.bounds()
        start = lo if start is None else start
        end = hi if end is None else end
        total, cur_s, cur_e = 0.0, None, None
        for s in sorted((s for s in self.spans if s.lane == lane), key=lambda s: s.start):
            a, b = max(s.start, start), min(s.end, end)
            if b <= a:
                continue
            if cur_e is None or a > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = a, b
            else:
                cur_e = max(cur_e, b)
        if cur_e is not None:
            total += cur_e - cur_s
        return total

    def gpu_active(self, start: float | None = None, end: float | None = None) -> float:
        """Fraction of the wall time [start, end] during which the compute stream worked."""
        lo, hi = self.bounds()
        start = lo if start is None else start
        end = hi if end is None else end
        return self.busy("compute", start, end) / max(end - start, 1e-12)

    def chrome_events(self, pid: int = 0, label: str = "") -> list[dict]:
        origin = self.bounds()[0]
        events = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label or "slipstream"}}]
        for tid, lane in enumerate(LANES):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}})
        for s in self.spans:
            events.append({"ph": "X", "name": s.name, "pid": pid, "tid": LANES.index(s.lane),
                           "ts": (s.start - origin) * 1e6, "dur": (s.end - s.start) * 1e6,
                           "args": {"batch": s.batch_id}})
        return events


def write_chrome_trace(path: str, timelines: dict[str, Timeline]) -> None:
    events = []
    for pid, (label, timeline) in enumerate(timelines.items()):
        events += timeline.chrome_events(pid, label)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
