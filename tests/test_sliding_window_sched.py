"""Early freeing of the KV blocks behind a sliding window (a model whose every layer is
windowed, e.g. Mistral with sliding_window set), against the model-free runner.

The fake runner reads a row's last `window` positions only, as the kernels do; a block freed
while some query of its request could still see it, and reused, changes the tokens.  Sync
and async loops must give exactly the direct computation, through prefix-cache hits,
chunked prefill and preemption; blocks must come back while requests still run, and all of
them by the end; debug_kv checks that no block is released under an in-flight batch.
"""
import pytest
from fake_runner import FakeRunner
from test_scheduler import EOS, expected, make_requests

from slipstream.core.step_loop import StepLoop
from slipstream.sched.block_pool import BlockPool
from slipstream.sched.in_flight import InFlight
from slipstream.sched.request import Request
from slipstream.sched.request_table import RequestTable
from slipstream.sched.scheduler import Scheduler

WINDOW = 24  # >= the 24 tokens the fake runner's draws depend on, so outputs are the direct ones


def run(specs, depth: int, num_blocks: int, window: int | None, block_size: int = 4,
        max_seqs: int = 6, max_tokens: int = 32):
    flight = InFlight()
    pool = BlockPool(num_blocks, block_size, True, flight, debug=True)
    table = RequestTable(max_seqs, 128, block_size)
    sched = Scheduler(pool, table, max_seqs, max_tokens, sliding_window=window)
    runner = FakeRunner(num_blocks, block_size, max_seqs, max_tokens, table.max_blocks, window=WINDOW,
                        check_pool=pool)
    loop = StepLoop(sched, runner, depth)
    todo = sorted(specs, key=lambda s: s["arrival"])
    done, step, peak = {}, 0, 0
    while todo or sched.has_unfinished() or loop.in_flight:
        while todo and todo[0]["arrival"] <= step:
            s = todo.pop(0)
            sched.add(Request(s["id"], list(s["prompt"]), s["params"], s["params"].seed, frozenset({EOS})))
        for req in loop.step():
            done[req.request_id] = req
        held = {b for r in sched.running for b in r.block_ids[r.num_freed_blocks:]}
        peak = max(peak, len(held))
        for r in sched.running:  # a running request holds at most its window's blocks (+ this step's)
            if window:
                assert len(r.block_ids) - r.num_freed_blocks <= -(-(window + max_tokens) // block_size) + 1
        step += 1
        assert step < 10_000
    assert pool.num_freeing == 0 and pool.num_free == num_blocks, "blocks leaked"
    return {rid: (r.output_token_ids, r.finish_reason) for rid, r in done.items()}, sched, pool, peak


def long_requests(n: int, seed: int):
    specs = make_requests(n, seed)
    for s in specs:  # long enough to slide past the window
        s["params"] = s["params"].__class__(**{**s["params"].to_dict(), "max_tokens": 40, "ignore_eos": True})
    return specs


@pytest.mark.parametrize("depth", [1, 2])
def test_early_freeing_keeps_outputs_and_returns_blocks(depth):
    specs = long_requests(16, seed=5)
    windowed, sched, pool, peak = run(specs, depth, num_blocks=200, window=WINDOW)
    full, _, _, full_peak = run(specs, depth, num_blocks=200, window=None)
    for s in specs:
        assert windowed[s["id"]] == expected(s), s["id"]
    assert windowed == full
    assert peak < full_peak, "blocks behind the window should go back while requests run"
    assert pool.num_hits > 0, "the shared prefix should still hit the cache"


def test_early_freeing_under_preemption_async_equals_sync():
    specs = long_requests(20, seed=6)
    sync, s1, _, _ = run(specs, 1, num_blocks=40, window=WINDOW, max_tokens=8)
    asyn, s2, _, _ = run(specs, 2, num_blocks=40, window=WINDOW, max_tokens=8)
    assert sync == asyn
    for s in specs:
        assert sync[s["id"]] == expected(s), s["id"]


def test_a_small_pool_runs_what_only_early_freeing_fits():
    # one request of 59 + 40 tokens needs 25 blocks of 4; with the window it holds ~9 at once
    specs = long_requests(3, seed=0)[:1]
    got, _, _, peak = run(specs, 2, num_blocks=14, window=WINDOW)
    assert got[specs[0]["id"]] == expected(specs[0])
    assert peak <= 14
