"""The registry of batches in flight, and the late frees that wait for them.

A batch is scheduled one step before the previous one has finished, so whatever a finished
request released (blocks, rows) may still be read or written by a batch on the GPU: it goes
back only once every batch that was in flight at the release has completed."""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable


class InFlight:
    """The one registry of batches launched but not completed (the runner's handle of each,
    registered once its launch succeeded), and the releases waiting for them."""

    def __init__(self) -> None:
        self.batches: OrderedDict[int, object] = OrderedDict()  # id -> the runner's handle
        self.blocks: dict[int, frozenset[int]] = {}  # id -> blocks it touches (debug_kv)
        self._waiting: deque[tuple[int, Callable[[], None]]] = deque()

    def __len__(self) -> int:
        return len(self.batches)

    def launched(self, batch_id: int, handle: object = None, blocks: frozenset[int] = frozenset()) -> None:
        self.batches[batch_id] = handle
        if blocks:
            self.blocks[batch_id] = blocks

    def oldest(self) -> object:
        return next(iter(self.batches.values()))

    def completed(self, batch_id: int) -> None:
        oldest = next(iter(self.batches), None)
        if oldest != batch_id:
            raise RuntimeError(f"batch {batch_id} completed out of order (oldest in flight: {oldest})")
        del self.batches[batch_id]
        self.blocks.pop(batch_id, None)
        while self._waiting and (not self.batches or self._waiting[0][0] < next(iter(self.batches))):
            self._waiting.popleft()[1]()

    def release_later(self, release: Callable[[], None]) -> None:
        """Run `release` once every batch in flight now has completed (at once if none)."""
        if not self.batches:
            release()
        else:
            self._waiting.append((next(reversed(self.batches)), release))
