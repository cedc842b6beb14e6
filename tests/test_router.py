"""The data-parallel router (least outstanding requests, prefix affinity under a load cap,
forgetting a restarted replica) and the KV budget of engines sharing one GPU."""
from __future__ import annotations

from slipstream.frontend.data_parallel import replica_gpus
from slipstream.frontend.router import Router, prefix_hashes
from slipstream.runner.kv_memory import GiB, kv_budget

BS = 16


def prompt(prefix: int, tail: int, blocks: int = 3) -> list[int]:
    return [prefix] * (blocks * BS) + [1000 + tail] * 5


def test_prefix_hashes_cover_full_blocks_only():
    assert len(prefix_hashes(list(range(47)), BS, 16)) == 2
    assert len(prefix_hashes(list(range(48 * 10)), BS, 16)) == 16
    a, b = prefix_hashes([1] * 32, BS, 8), prefix_hashes([1] * 16 + [2] * 16, BS, 8)
    assert a[0] == b[0] and a[1] != b[1]


def test_least_outstanding_then_round_robin_on_ties():
    r = Router(3, BS)
    up = [True] * 3
    assert [r.pick([i], up) for i in range(3)] == [0, 1, 2]
    r.finish(1)
    assert r.pick([9], up) == 1  # the only one with nothing outstanding
    assert r.pick([9], [True, False, True]) in (0, 2)


def test_shared_prefix_sticks_to_one_replica_until_it_is_overloaded():
    r = Router(2, BS, slack=2)
    up = [True, True]
    first = r.pick(prompt(7, 0), up)
    # the other replica is idle, yet the prefix's owner takes the next ones ...
    assert [r.pick(prompt(7, i), up) for i in range(1, 3)] == [first] * 2
    assert r.loads[first].affine == 2
    # ... until it is more than `slack` requests busier than the least loaded
    other = 1 - first
    assert r.pick(prompt(7, 3), up) == other
    assert r.pick(prompt(8, 0), up) == other  # a new prefix goes by load
    # the owner (now `other`) is down: the prefix goes elsewhere
    assert r.pick(prompt(7, 4), [i == first for i in range(2)]) == first
    # a restarted replica has forgotten its prefixes: by load again
    r.forget(first)
    for replica in [first] * 4 + [other] * 2:
        r.finish(replica)
    affine = r.loads[other].affine
    assert r.pick(prompt(7, 5), up) == other and r.loads[other].affine == affine


def test_kv_budget_of_two_replicas_sharing_a_gpu():
    total, ctx = 141 * GiB, GiB // 2
    # replica 0 starts on an empty GPU, then replica 1 next to it: both get the same share
    first = kv_budget(total, free=total - ctx - 2 * GiB, reserved=2 * GiB, used_at_start=ctx,
                      utilization=0.45, peak=3 * GiB, graph_reserve=GiB)
    held = int(total * 0.45) + ctx
    second = kv_budget(total, free=total - held - ctx - 2 * GiB, reserved=2 * GiB,
                       used_at_start=held + ctx, utilization=0.45, peak=3 * GiB, graph_reserve=GiB)
    assert abs(first - second) < 1 and first == total * 0.45 - 4 * GiB
    # never more than what was free at the start
    greedy = kv_budget(total, free=total - held - ctx - 2 * GiB, reserved=2 * GiB,
                       used_at_start=held + ctx, utilization=0.9, peak=3 * GiB, graph_reserve=GiB)
    assert greedy == total - held - ctx - 4 * GiB


def test_replica_gpus():
    eight = [str(i) for i in range(8)]
    assert [replica_gpus(i, 8, 1, eight) for i in range(8)] == [[g] for g in eight]
    assert [replica_gpus(i, 4, 2, eight) for i in range(4)] == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
    assert [replica_gpus(i, 2, 1, ["0"]) for i in range(2)] == [["0"], ["0"]]  # two share one GPU
    assert [replica_gpus(i, 4, 1, ["3", "5"]) for i in range(4)] == [["3"], ["5"], ["3"], ["5"]]
    assert replica_gpus(0, 2, 1, []) is None
