"""The benchmark arithmetic: GPU active time (union of spans), the floor, the step breakdown."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from slipstream.bench.run import ceilings_line
from slipstream.bench.throughput import breakdown_table, step_breakdown, step_floors
from slipstream.core.tracing import BatchStats, Span, Timeline
from slipstream.model.config import ModelConfig

CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)


def test_busy_is_the_union_of_overlapping_spans():
    tl = Timeline([Span("compute", "compute", 0.0, 2.0, 0), Span("compute", "compute", 1.0, 3.0, 1),
                   Span("compute", "compute", 5.0, 6.0, 2), Span("cpu", "schedule", 0.0, 10.0, 2)])
    assert tl.busy("compute") == pytest.approx(4.0)
    assert tl.busy("compute", 2.5, 5.5) == pytest.approx(1.0)
    assert tl.gpu_active(0.0, 8.0) == pytest.approx(0.5)


def test_step_floor_counts_weights_kv_and_flops():
    # one decode step of 3 rows with 10 tokens of context each, bf16
    tl = Timeline(batches=[BatchStats(0, num_tokens=3, num_samples=3, context_tokens=30, attention_pairs=30.0)])
    bw, rate = 1e9, 1e12
    layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128
    weights = (2 * layer + 1000 * 64) * 2
    kv = 2 * 2 * 32 * 2 * (30 + 3)
    (floor,) = step_floors(tl, CFG, torch.bfloat16, bw, rate)
    assert floor == pytest.approx((weights + kv) / bw)  # memory bound at these rates
    (compute_bound,) = step_floors(tl, CFG, torch.bfloat16, 1e18, 1e6)
    flops = 2 * 2 * layer * 3 + 2 * 1000 * 64 * 3 + 4 * 2 * 64 * 30.0
    assert compute_bound == pytest.approx(flops / 1e6)


def _brute_force_window(starts, num_new, window):
    """(keys read, attention pairs) by enumerating each query's window (p - W, p]."""
    read = pairs = 0
    for s, n in zip(starts, num_new):
        keys = set()
        for p in range(s, s + n):
            seen = range(max(0, p - window + 1), p + 1)
            keys.update(seen)
            pairs += len(seen)
        read += len(keys)
    return read, pairs


@pytest.mark.parametrize("starts,num_new", [([9, 2], [1, 1]), ([0, 5, 30], [6, 3, 1]), ([0], [17])])
def test_windowed_batch_stats_count_the_keys_a_sliding_layer_reads(starts, num_new):
    tl = Timeline()
    tl.batch(SimpleNamespace(batch_id=0, start=np.array(starts), num_new=np.array(num_new),
                             sampled=[0] * len(starts)))
    (b,) = tl.batches
    for window in (1, 4, 7, 100):
        assert b.windowed(window) == _brute_force_window(starts, num_new, window)
    assert b.windowed(100) == (b.context_tokens, b.attention_pairs)  # a window past every context


def test_step_floor_of_a_model_with_sliding_layers_counts_their_window():
    """Two of three layers slide with a 4-key window: their KV reads and attention pairs are
    the window's, the full layer's the whole context."""
    cfg = replace(CFG, architecture="MistralForCausalLM", num_layers=3, sliding_window=4,
                  layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    tl = Timeline()
    tl.batch(SimpleNamespace(batch_id=0, start=np.array([9, 2, 0]), num_new=np.array([1, 1, 6]),
                             sampled=[0, 1, 2]))
    (b,) = tl.batches
    read_w, pairs_w = 4 + 3 + 6, 4 + 3 + (1 + 2 + 3 + 4 + 4 + 4)
    assert b.windowed(4) == (read_w, pairs_w)
    layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128
    weights = (3 * layer + 1000 * 64) * 2
    per_layer_token = 2 * 32 * 2  # K and V of a token in one layer, bf16
    kv = per_layer_token * (2 * read_w + b.context_tokens + 3 * b.num_tokens)
    (floor,) = step_floors(tl, cfg, torch.bfloat16, 1e9, 1e12)
    assert floor == pytest.approx((weights + kv) / 1e9)
    (unwindowed,) = step_floors(tl, replace(cfg, sliding_window=None), torch.bfloat16, 1e9, 1e12)
    assert unwindowed == pytest.approx((weights + per_layer_token * 3 * (b.context_tokens + b.num_tokens)) / 1e9)
    (compute_bound,) = step_floors(tl, cfg, torch.bfloat16, 1e18, 1e6)
    flops = 2 * 3 * layer * 8 + 2 * 1000 * 64 * 3 + 4 * 64 * (2 * pairs_w + b.attention_pairs)
    assert compute_bound == pytest.approx(flops / 1e6)


def test_step_breakdown_groups_steps_and_counts_idle_time():
    batches = [BatchStats(0, 100, 4, 100, 0.0),  # a prefill chunk
               BatchStats(1, 4, 4, 400, 0.0), BatchStats(2, 200, 200, 9000, 0.0),
               BatchStats(3, 20, 4, 400, 0.0, verify=True)]  # 4 rows of 5 tokens (k = 4)
    spans = [Span("compute", "compute", 0.0, 1.0, 0), Span("compute", "compute", 1.5, 2.0, 1),
             Span("compute", "compute", 2.0, 4.0, 2), Span("cpu", "schedule", 0.0, 0.2, 1),
             Span("cpu", "wait", 0.2, 0.9, 1), Span("cpu", "process", 0.9, 1.0, 1),
             Span("compute", "compute", 4.0, 4.5, 3)]
    rows = step_breakdown(Timeline(spans, batches), [0.5, 0.25, 1.0, 0.25])
    by = {r["group"]: r for r in rows}
    assert set(by) == {"with prefill", "decode 1-16", "decode 129-256", "verify 1-16"}
    assert by["verify 1-16"]["steps"] == 1 and by["verify 1-16"]["gpu_s"] == pytest.approx(0.5)
    assert by["with prefill"]["gpu_s"] == pytest.approx(1.0) and by["with prefill"]["gpu_over_floor"] == 2
    assert by["decode 1-16"]["idle_s"] == pytest.approx(0.5)  # waited from 1.0 to 1.5
    assert by["decode 129-256"]["idle_s"] == 0 and by["decode 129-256"]["floor_s"] == 1.0
    assert by["decode 1-16"]["cpu_s"] == pytest.approx(0.3) and by["with prefill"]["cpu_s"] == 0  # no waits
    assert "| decode 1-16 | 1 | 0.500 s | 0.250 s | 2.00 |" in breakdown_table(rows)


def test_a_speculative_step_without_a_prompt_chunk_is_a_verify_step():
    """The timeline marks a batch with drafts whose rows all sample with at most k + 1 tokens
    (not one with a prompt chunk, nor a plain one), and the breakdown groups it by rows."""
    def batch(i, num_new, sampled, spec):
        n = np.array(num_new)
        return SimpleNamespace(batch_id=i, start=np.full(len(n), 10), num_new=n, num_seqs=len(n),
                               sampled=sampled, spec=spec)

    tl = Timeline()
    k3 = SimpleNamespace(k=3)
    tl.batch(batch(0, [4, 1], [0, 1], k3))
    tl.batch(batch(1, [16, 4], [1], k3))  # a prompt chunk beside a drafting row
    tl.batch(batch(2, [16, 4], [0, 1], k3))  # a row of more than k + 1 tokens
    tl.batch(batch(3, [1, 1], [0, 1], None))
    assert [b.verify for b in tl.batches] == [True, False, False, False]
    tl.spans = [Span("compute", "compute", i, i + 0.5, i) for i in range(4)]
    groups = [r["group"] for r in step_breakdown(tl, [0.1] * 4)]
    assert sorted(groups) == ["decode 1-16", "verify 1-16", "with prefill"]


def _pipelined(n: int) -> Timeline:
    """n batches: CPU schedule, then H2D, compute and D2H, the next batch overlapping."""
    tl = Timeline()
    for i in range(n):
        t = i * 1.0
        tl.cpu("schedule", t, t + 0.2, i)
        tl.gpu(i, {"h2d": (t + 0.2, t + 0.25), "compute": (t + 0.25, t + 1.25), "d2h": (t + 1.25, t + 1.3)})
        tl.batches.append(BatchStats(i, 4, 4, 40, 0.0))
    return tl


def test_chrome_trace_and_middle_window(tmp_path):
    import json

    from slipstream.core.tracing import write_chrome_trace
    tl = _pipelined(20)
    mid = tl.middle(4)
    assert sorted({s.batch_id for s in mid.spans}) == [8, 9, 10, 11] and len(mid.batches) == 4
    path = tmp_path / "trace.json"
    write_chrome_trace(str(path), {"async": mid})
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 4 * 4 and {e["tid"] for e in spans} == {0, 1, 2, 3}
    assert min(e["ts"] for e in spans) == 0.0  # relative to the window's first span
    assert {e["args"]["name"] for e in events if e["name"] == "thread_name"} == {"cpu", "h2d", "compute", "d2h"}


@pytest.mark.slow
def test_png_timeline(tmp_path):
    # matplotlib comes with the bench extra, which scripts/setup.sh (CI) installs
    from slipstream.bench.plot import plot_timelines, steady_window
    tl = _pipelined(20)
    lo, hi = steady_window(tl, 8)
    assert hi - lo == pytest.approx(8.0) and tl.gpu_active(lo, hi) == pytest.approx(1.0)
    path = tmp_path / "t.png"
    plot_timelines({"sync": tl, "async": tl}, str(path), title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_json_creates_the_folder(tmp_path):
    import json

    from slipstream.bench.report import write_json
    path = write_json(str(tmp_path / "a" / "b"), "r.json", {"x": [1, 2]}, indent=1)
    assert path == str(tmp_path / "a" / "b" / "r.json") and json.loads(open(path).read()) == {"x": [1, 2]}


def test_gc_pauses_records_collections_by_generation():
    import gc

    from slipstream.bench.throughput import GcPauses

    with GcPauses() as pauses:
        gc.collect(0)
        gc.collect(2)
    summary = pauses.summary()
    assert summary["gen0"]["count"] >= 1 and summary["gen2"]["count"] >= 1
    assert summary["gen2"]["max_ms"] >= 0.0 and summary["gen2"]["total_ms"] >= summary["gen2"]["max_ms"]
    assert pauses._callback not in gc.callbacks  # removed on exit
    with GcPauses() as quiet:
        pass
    assert quiet.summary() == {}


def test_freeze_gc_moves_live_objects_out_of_the_collector():
    import gc

    from slipstream.utils.process import freeze_gc

    try:
        freeze_gc()
        assert gc.get_freeze_count() > 1000  # at least the imported modules' objects
        assert gc.get_count()[0] < 100  # the young generation starts empty
    finally:
        gc.unfreeze()


@pytest.mark.slow
def test_the_collector_is_off_while_an_engine_is_built_and_back_after(monkeypatch):
    import gc

    from slipstream.core import engine_core
    from slipstream.utils.process import collector_paused

    seen = []
    real_build = engine_core.EngineCore._build

    def build(self, *args):
        seen.append(gc.isenabled())
        real_build(self, *args)
    monkeypatch.setattr(engine_core.EngineCore, "_build", build)
    from slipstream.config import EngineConfig
    engine_core.EngineCore(EngineConfig(load_format="dummy", device="cpu", max_num_seqs=2, max_model_len=64))
    assert seen == [False] and gc.isenabled()
    with pytest.raises(KeyError):  # a failed build turns it back on too
        with collector_paused():
            raise KeyError("x")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()


@pytest.mark.parametrize("name,parent,n", [("seed-8b-bs1", "seed-8b-short", 1), ("small-bs1", "small-256", 1),
                                           ("seed-8b-bs8", "seed-8b-short", 8)])
def test_latency_workloads_are_the_first_requests_of_their_parents(name, parent, n):
    from slipstream.bench.workloads import get_workload
    w, p = get_workload(name), get_workload(parent)
    assert w.name == name and w.latency and not p.latency
    assert len(w.prompts) == len(w.params) == n
    assert w.prompts == p.prompts[:n] and w.params == p.params[:n]
    assert w.model == p.model and w.engine == p.engine and w.engine is not p.engine
    assert w.num_output_tokens == sum(q.max_tokens for q in p.params[:n])


def test_warm_up_runs_a_speculative_latency_workload_to_its_full_length():
    # its verify and drafting graphs (one a decode split count) are captured at first use:
    # warmed up at full length, the timed run replays them as plain decoding's graphs are
    from slipstream.bench.run import warm_up_tokens
    from slipstream.bench.workloads import get_workload
    bs1, bs8, small = get_workload("seed-8b-bs1"), get_workload("seed-8b-bs8"), get_workload("small-256")
    assert warm_up_tokens(bs1, speculative=True) == [1024] and warm_up_tokens(bs1, speculative=False) == [2]
    assert warm_up_tokens(bs8, speculative=True) == [1024] * 8
    assert warm_up_tokens(small, speculative=True) == [2] * 256  # a throughput workload: 2 tokens
    json = get_workload("small-256-json")
    assert warm_up_tokens(json, speculative=False) == [2 + i for i in range(len(json.params))]


def test_run_result_ms_per_step_adds_a_column_and_a_json_key():
    from slipstream.bench.throughput import RunResult, result_dict
    r = RunResult("w", "sync", wall_s=1.5, output_tokens=100, tokens_per_s=66.7, steps=60, gpu_active=None,
                  floor_s=0.5, wall_over_floor=3.0, cpu_ms_per_step=1.0, gpu_ms_per_step=None)
    assert r.ms_per_step == pytest.approx(25.0)
    plain = "| w | sync | 1.50 s | 67 | - | 0.50 s | 3.00 | 1.00 | - | 60 |"
    assert r.row() == plain and r.row(ms_per_step=True) == plain + " 25.00 |"  # the plain row is unchanged
    assert RunResult.header().endswith("| steps |\n" + "|---" * 10 + "|")
    assert RunResult.header(ms_per_step=True).endswith("| steps | ms per step |\n" + "|---" * 11 + "|")
    d = result_dict(r)
    assert d["ms_per_step"] == pytest.approx(25.0) and d["wall_s"] == 1.5 and d["steps"] == 60  # keys added, kept
    empty = RunResult("w", "sync", 0.0, 0, 0.0, 0, None, 0.0, float("nan"), 0.0, None)
    assert empty.ms_per_step is None and empty.row(ms_per_step=True).endswith("| 0 | - |")


def test_the_ceilings_line_says_whether_they_were_measured():
    measured = ceilings_line(3.0e12, 700e12, measured=True)
    recorded = ceilings_line(4.26e12, 792e12, measured=False)
    assert "measured on this GPU" in measured and "copy 3.00 TB/s, matmul 700 TFLOP/s" in measured
    assert "H200" in recorded and "not measured" in recorded and "copy 4.26 TB/s" in recorded


def test_an_unmeasured_run_takes_its_own_gpus_recorded_ceilings():
    from slipstream.bench.throughput import recorded_ceilings
    assert recorded_ceilings("NVIDIA H100 80GB HBM3") == ("H100", 3.01e12, 790e12)
    assert recorded_ceilings("NVIDIA H200") == ("H200", 4.26e12, 792e12)
    assert recorded_ceilings("NVIDIA A100-SXM4-80GB")[0] == "H200"  # no record: the H200's, said so
    line = ceilings_line(*recorded_ceilings("NVIDIA H100 80GB HBM3")[1:], measured=False, gpu="H100")
    assert "the H100's recorded ones" in line and "copy 3.01 TB/s" in line


def test_a_failed_request_fails_the_run_with_its_error():
    """A request that ends in "error" (a grammar backend that cannot start, ...) stops the
    benchmark with one line naming it, instead of a run that measured nothing."""
    from slipstream.bench.throughput import run_until_done

    class Engine:
        def __init__(self):
            self.steps = [[SimpleNamespace(request_id="0", new_token_ids=[5], finish_reason=None, error=None)],
                          [SimpleNamespace(request_id="1", new_token_ids=[], finish_reason="error",
                                           error="structured outputs are unavailable: no backend"),
                           SimpleNamespace(request_id="0", new_token_ids=[6], finish_reason="length", error=None)]]

        def has_work(self):
            return bool(self.steps)

        def step(self):
            return self.steps.pop(0)

    with pytest.raises(ValueError, match="1 requests failed; the first, '1': structured outputs are unavailable"):
        run_until_done(Engine())
    ok = Engine()
    ok.steps[1].pop(0)
    assert run_until_done(ok) == {"0": [5, 6]}
