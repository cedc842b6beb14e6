"""`Router`: which data-parallel replica takes a request.

The replica with the fewest requests outstanding, unless one already holds a prefix of
the prompt: requests that share a prompt prefix then meet the same prefix cache.  The
router remembers, per full KV block of the first `max_blocks`, a hash of the prompt up to
that block and the replica it went to (bounded, least recently used first out).
Affinity yields to load: a replica more than `slack` requests busier than the least
loaded one gets no more affine requests.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from slipstream.sched.block_pool import prefix_block_keys


def prefix_hashes(token_ids: list[int], block_size: int, max_blocks: int) -> list[int]:
    """One int per full block of the first `max_blocks`, standing for the prompt from its
    start to the end of that block: the hash of the prefix cache's key (kv_cache.py)."""
    num_blocks = min(len(token_ids) // block_size, max_blocks)
    return [hash(key) for key in prefix_block_keys(token_ids, block_size, num_blocks)]


@dataclass
class ReplicaLoad:
    outstanding: int = 0  # requests routed here and not ended
    routed: int = 0
    affine: int = 0  # routed here because it held the prompt's prefix


@dataclass
class Router:
    num_replicas: int
    block_size: int
    max_blocks: int = 16
    slack: int = 8
    capacity: int = 1 << 16  # prefixes remembered
    loads: list[ReplicaLoad] = field(default_factory=list)
    _owner: OrderedDict = field(default_factory=OrderedDict)

    def __post_init__(self):
        self.loads = [ReplicaLoad() for _ in range(self.num_replicas)]

    def pick(self, token_ids: list[int], up: list[bool]) -> int:
        """The replica for a prompt among those `up`; counts it as outstanding there."""
        live = [i for i in range(self.num_replicas) if up[i]]
        if not live:
            raise LookupError("no replica is up")
        least = min(live, key=lambda i: (self.loads[i].outstanding, self.loads[i].routed))
        hashes = prefix_hashes(token_ids, self.block_size, self.max_blocks)
        choice, affine = least, False
        for h in reversed(hashes):  # the longest remembered prefix first
            owner = self._owner.get(h)
            if owner is not None and up[owner]:
                if self.loads[owner].outstanding <= self.loads[least].outstanding + self.slack:
                    choice, affine = owner, True
                break
        for h in hashes:
            self._owner[h] = choice
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
        load = self.loads[choice]
        load.outstanding += 1
        load.routed += 1
        load.affine += affine
        return choice

    def finish(self, replica: int) -> None:
        self.loads[replica].outstanding -= 1

    def forget(self, replica: int) -> None:
        """A replica restarted: its prefix cache is empty."""
        for h in [h for h, r in self._owner.items() if r == replica]:
            del self._owner[h]
