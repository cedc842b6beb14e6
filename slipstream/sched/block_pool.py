"""Paged KV blocks: reference counts, prefix caching with LRU eviction, and late freeing.

The pool hands out block ids; the tensors live in the runner.  Two rules of the
asynchronous engine live here:

* Free late.  A batch is scheduled one step before the previous one has finished, so
  a block released by the scheduler may still be read or written by an in-flight
  batch.  `free()` is the single way blocks come back; while batches are in flight it
  only queues them, and `batch_completed()` returns them once every batch that was in
  flight at the time of the free has completed.  Evicting a prefix block can only
  happen to blocks that came back this way, so it is late too.
* Prefix caching.  A full block is keyed by (key of the previous block, its tokens).
  Blocks whose reference count drops to zero stay in the hash table and join the free
  queue at its tail; allocation takes from the head (least recently freed), evicting
  the cached content of the block it takes.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Sequence

from slipstream.sched.in_flight import InFlight


def prefix_block_keys(token_ids: Sequence[int], block_size: int, num_blocks: int,
                      known: list[Hashable] | None = None) -> list[Hashable]:
    """One key per full block of the first `num_blocks`: (hash of the previous block's key,
    this block's tokens), so a key stands for the whole prefix up to its block; extends
    `known` (the keys already computed).  The prefix cache's keys, and the data-parallel
    router's (frontend/router.py)."""
    keys = list(known or [])
    bs = block_size
    parent = keys[-1] if keys else None
    first = len(keys)
    span = token_ids[first * bs:num_blocks * bs]
    if hasattr(span, "tolist"):  # a numpy row: one conversion, not one per block
        span = span.tolist()
    for i in range(num_blocks - first):
        parent = (hash(parent), tuple(span[i * bs:(i + 1) * bs]))
        keys.append(parent)
    return keys


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 in_flight: InFlight | None = None, debug: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.in_flight = in_flight if in_flight is not None else InFlight()
        self.debug = debug
        self.ref_count = [0] * num_blocks
        self.block_key: list[Hashable | None] = [None] * num_blocks
        self.cached: dict[Hashable, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.num_freeing = 0  # blocks queued by free() behind in-flight batches
        self.num_hits = 0  # prefix-cache blocks reused (a statistic)
        self.num_queries = 0  # full prompt blocks looked up at admission (a statistic)

    # -- allocation -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self.free_queue)} free")
        blocks = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            key = self.block_key[block]
            if key is not None:  # evict its cached content
                if self.cached.get(key) == block:
                    del self.cached[key]
                self.block_key[block] = None
            self.ref_count[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; the last frees it, after in-flight batches."""
        blocks = list(blocks)
        if not blocks:
            return
        self.num_freeing += len(blocks)
        self.in_flight.release_later(lambda: self._release(blocks))

    def _release(self, blocks: list[int]) -> None:
        self.num_freeing -= len(blocks)
        for block in reversed(blocks):  # tail blocks first: evicted before the shared prefix
            if self.debug:
                for batch_id, used in self.in_flight.blocks.items():
                    assert block not in used or self.ref_count[block] > 1, (
                        f"block {block} freed while in-flight batch {batch_id} uses it")
            self.ref_count[block] -= 1
            assert self.ref_count[block] >= 0, f"block {block} freed twice"
            if self.ref_count[block] == 0:
                self.free_queue[block] = None

    # -- prefix cache -----------------------------------------------------------------
    def block_keys(self, token_ids: Sequence[int], num_blocks: int,
                   known: list[Hashable] | None = None) -> list[Hashable]:
        """Keys of the first `num_blocks` full blocks, extending `known` (already computed)."""
        return prefix_block_keys(token_ids, self.block_size, num_blocks, known)

    def peek(self, keys: Sequence[Hashable]) -> list[int]:
        """Longest run of cached blocks matching `keys` (no reference taken)."""
        hits = []
        if self.enable_prefix_caching:
            for key in keys:
                block = self.cached.get(key)
                if block is None:
                    break
                hits.append(block)
        return hits

    def num_free_among(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` sit in the free queue (taking them shrinks it)."""
        return sum(1 for b in blocks if self.ref_count[b] == 0)

    def take(self, blocks: Sequence[int]) -> None:
        """Take a reference to each of `blocks` (prefix-cache hits)."""
        for block in blocks:
            if self.ref_count[block] == 0:
                del self.free_queue[block]
            self.ref_count[block] += 1
        self.num_hits += len(blocks)

    def register(self, block: int, key: Hashable) -> None:
        """Mark a block as holding the KV of `key` (its tokens are scheduled)."""
        if self.enable_prefix_caching and key not in self.cached and self.block_key[block] is None:
            self.cached[key] = block
            self.block_key[block] = key

    def reset_prefix_cache(self) -> None:
        self.cached.clear()
        self.block_key = [None] * self.num_blocks
