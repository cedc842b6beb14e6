"""Scheduler + overlap loop against a model-free runner (tests/fake_runner.py).

The async loop (depth 2) must give exactly the tokens and finish reasons of the sync
loop (depth 1), and both must equal the tokens computed directly, through chunked
prefill, prefix-cache hits, preemption, staggered arrivals, stops and aborts.
"""
import random

import pytest

from slipstream.core.step_loop import StepLoop
from slipstream.sched.block_pool import BlockPool
from slipstream.sched.in_flight import InFlight
from slipstream.sched.request import Request
from slipstream.sched.request_table import RequestTable
from slipstream.sampling.params import SamplingParams
from slipstream.sched.scheduler import Scheduler
from fake_runner import FakeRunner, reference_output

EOS = 5


def make_requests(n: int, seed: int = 0):
    rng = random.Random(seed)
    shared = [rng.randrange(90) for _ in range(19)]
    specs = []
    for i in range(n):
        prompt = [rng.randrange(90) for _ in range(rng.randint(1, 40))]
        if i % 3 == 0:
            prompt = shared + prompt  # shared prefix: prefix-cache hits
        params = SamplingParams(
            max_tokens=rng.randint(1, 30), seed=rng.randrange(1000),
            ignore_eos=(i % 4 == 0), min_tokens=(3 if i % 5 == 0 else 0),
            stop_token_ids=([7] if i % 6 == 0 else []))
        specs.append(dict(id=f"r{i}", prompt=prompt, params=params, arrival=rng.choice([0, 0, 0, 2, 5, 9])))
    return specs


def run(specs, depth: int, num_blocks: int, block_size: int = 4, max_seqs: int = 6,
        max_tokens: int = 32, abort_after: dict | None = None, prefix_caching: bool = True,
        stats: dict | None = None):
    max_model_len = 128
    flight = InFlight()
    pool = BlockPool(num_blocks, block_size, prefix_caching, flight, debug=True)
    table = RequestTable(max_seqs, max_model_len, block_size)
    sched = Scheduler(pool, table, max_seqs, max_tokens)
    runner = FakeRunner(num_blocks, block_size, max_seqs, max_tokens, table.max_blocks)
    loop = StepLoop(sched, runner, depth)
    abort_after = abort_after or {}
    todo = sorted(specs, key=lambda s: s["arrival"])
    live, done, step = {}, {}, 0
    while todo or sched.has_unfinished() or loop.in_flight:
        while todo and todo[0]["arrival"] <= step:
            s = todo.pop(0)
            req = Request(s["id"], list(s["prompt"]), s["params"], s["params"].seed, frozenset({EOS}))
            live[req.request_id] = req
            sched.add(req)
        for req in loop.step():
            done[req.request_id] = req
        for rid, k in abort_after.items():
            req = live.get(rid)
            if req is not None and not req.finished and len(req.output_token_ids) >= k:
                sched.finish(req, "abort")
                done[rid] = req
        step += 1
        assert step < 10_000
    assert pool.num_freeing == 0 and pool.num_free == num_blocks, "blocks leaked"
    assert table.num_free_rows == max_seqs, "request rows leaked"
    if stats is not None:
        stats["mixed_decode_rows"] = runner.mixed_decode_rows
    return {rid: (r.output_token_ids, r.finish_reason) for rid, r in done.items()}, sched, pool


def expected(spec):
    p = spec["params"]
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})
    out = reference_output(spec["prompt"], p.seed, p.max_tokens, stops, p.min_tokens)
    reason = "stop" if out[-1] in stops and len(out) > p.min_tokens else "length"
    return out, reason


@pytest.mark.parametrize("depth", [1, 2])
def test_outputs_equal_direct_computation(depth):
    specs = make_requests(24)
    stats = {}
    got, sched, pool = run(specs, depth, num_blocks=200, stats=stats)
    for s in specs:
        assert got[s["id"]] == expected(s), s["id"]
    assert pool.num_hits > 0, "the shared prefix should hit the cache"
    assert stats["mixed_decode_rows"] > 0, "staggered arrivals should mix decodes into prefill batches"


def test_async_equals_sync_under_preemption_small_chunks_and_aborts():
    specs = make_requests(30, seed=1)
    aborts = {"r3": 2, "r10": 5, "r17": 1}
    common = dict(num_blocks=26, max_tokens=8, abort_after=aborts)
    sync, s1, _ = run(specs, 1, **common)
    asyn, s2, _ = run(specs, 2, **common)
    assert sync == asyn
    assert s1.num_preemptions > 0 and s2.num_preemptions > 0, "the pool should be small enough to preempt"
    for s in specs:
        if s["id"] in aborts:
            assert sync[s["id"]][1] == "abort"
            assert sync[s["id"]][0] == expected(s)[0][:aborts[s["id"]]]
        else:
            assert sync[s["id"]] == expected(s), s["id"]


def test_prefix_caching_off_gives_the_same_outputs():
    specs = make_requests(12, seed=2)
    on, _, pool_on = run(specs, 2, num_blocks=120)
    off, _, pool_off = run(specs, 2, num_blocks=120, prefix_caching=False)
    assert on == off
    assert pool_on.num_hits > 0 and pool_off.num_hits == 0


def test_one_token_budget_is_all_decode_or_one_chunk():
    """With max_num_batched_tokens == max_num_seqs the prefill is chunked hard."""
    specs = make_requests(8, seed=3)
    got, _, _ = run(specs, 2, num_blocks=200, max_seqs=4, max_tokens=4)
    for s in specs:
        assert got[s["id"]] == expected(s)


def test_tokens_after_a_finish_are_dropped():
    # r0 stops at once on its stop token id; the async loop had already scheduled it again.
    prompt = [1, 2, 3]
    probe = reference_output(prompt, 11, 1)
    spec = dict(id="r0", prompt=prompt, arrival=0,
                params=SamplingParams(max_tokens=20, seed=11, stop_token_ids=[probe[0]]))
    got, _, _ = run([spec], 2, num_blocks=50)
    assert got["r0"] == ([probe[0]], "stop")
