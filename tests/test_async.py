"""Async (depth 2) and sync (depth 1) give identical tokens, text and finish reasons, on
the CPU where streams and events are no-ops but the one-step-ahead control flow runs."""
import pytest
import torch
from async_mix import mix, run_mix

import slipstream.runner.model_runner as runner_module
from slipstream import LLM
from slipstream.runner.graphs import StepGraphs, capture_sizes, mixed_graph_tokens, mixed_token_sizes
from slipstream.runner.inputs import StepPad


# little KV (preemptions) and small steps (chunked prefill, mixed batches)
COMMON = dict(device="cpu", max_model_len=256, num_kv_blocks=24, max_num_batched_tokens=64,
              max_num_seqs=12, debug_kv=True)


@pytest.fixture(scope="module")
def sync_mix(tokenized_tiny):
    """The mixed workload and the sync engine's results, the reference of both tests below
    (one run of the mix, ~3 s of CPU)."""
    reqs = mix(tokenized_tiny)
    sync = LLM(tokenized_tiny, async_scheduling=False, **COMMON)
    return reqs, sync, run_mix(sync, reqs)


@pytest.mark.slow
def test_async_equals_sync_on_a_mixed_workload(tokenized_tiny, sync_mix):
    reqs, sync, got_sync = sync_mix
    assert len(reqs) >= 24
    asyn = LLM(tokenized_tiny, async_scheduling=True, **COMMON)
    got_async = run_mix(asyn, reqs)
    assert got_sync == got_async
    reasons = {r for _, _, r in got_sync.values()}
    assert reasons == {"stop", "length", "abort"}, reasons
    by_string = [r["id"] for r in reqs if r["params"].stop and got_sync[r["id"]][2] == "stop"]
    by_eos = [r["id"] for r in reqs if not r["params"].stop and got_sync[r["id"]][2] == "stop"]
    assert by_string and by_eos, "stop strings and EOS should each end some requests"
    for llm in (sync, asyn):
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.pool.num_hits > 0
        assert llm.engine.pool.num_free == llm.engine.pool.num_blocks  # nothing leaked


@pytest.mark.slow
def test_async_drops_the_token_drawn_after_a_stop(tokenized_tiny):
    """The request is scheduled again before its stop token is seen; that draw is dropped."""
    llm = LLM(tokenized_tiny, device="cpu", max_model_len=256, async_scheduling=True)
    from slipstream import SamplingParams
    first = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    out = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=8, temperature=0,
                                                   stop_token_ids=[first.token_ids[1]]))[0]
    assert out.token_ids == first.token_ids[:2] and out.finish_reason == "stop"
    assert llm.engine.loop.num_batches > 3  # the pipeline did run ahead


@pytest.mark.slow
def test_graph_padding_changes_no_output(tokenized_tiny, sync_mix):
    """Decode batches padded to a graph's rows and mixed batches padded to its tokens and
    max_num_seqs rows (padding rows own no token) give the unpadded outputs, sync and async."""
    reqs, _, plain = sync_mix
    mixed_sizes = mixed_token_sizes(64, smallest=16)
    assert mixed_sizes == [16, 32, 48, 64]
    for async_scheduling in (False, True):
        llm = LLM(tokenized_tiny, async_scheduling=async_scheduling, **COMMON)
        runner = llm.engine.runner
        # the sizes and padding of CUDA graphs, none captured: every batch that fits a size
        # is padded like a graph batch and runs eagerly with the padded shapes
        runner.graphs = StepGraphs(capture_sizes(12), mixed_sizes, 12, 256)
        shapes = []
        fill = runner_module.fill_inputs
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(runner_module, "fill_inputs", lambda *a: shapes.append(fill(*a)) or shapes[-1])
            assert run_mix(llm, reqs) == plain
        mixed = [s for s in shapes if s.padded and not s.is_decode]
        assert mixed and [s for s in shapes if s.padded and s.is_decode]
        assert all(s.num_seqs == 12 and s.num_tokens in mixed_sizes for s in mixed)
        assert any(s.num_tokens > 16 for s in mixed)


def test_graph_sizes_and_padding():
    assert mixed_token_sizes(8192) == [512, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
    assert mixed_token_sizes(1000) == [512, 1000] and mixed_token_sizes(0) == []
    graphs = StepGraphs(capture_sizes(12), [16, 32, 48, 64], 12, 256)
    assert graphs.decode_sizes == [1, 2, 4, 8, 12]
    assert graphs.padding(5, 5, decode=True) == StepPad(8, 8)
    assert graphs.padding(13, 13, decode=True) is None  # larger than any decode graph
    assert graphs.padding(17, 3, decode=False) == StepPad(32, 12)  # rows padded to max_num_seqs
    assert graphs.padding(65, 3, decode=False) is None  # more tokens than any mixed graph
    # mixed graphs (and their memory reserve) only when decode graphs reach max_num_seqs
    from types import SimpleNamespace
    opts = SimpleNamespace(use_cuda_graphs=True, cuda_graph_max_batch=256, max_num_seqs=256,
                           cuda_graph_max_tokens=4096, max_num_batched_tokens=8192)
    assert mixed_graph_tokens(opts) == 4096
    assert mixed_graph_tokens(SimpleNamespace(**{**vars(opts), "cuda_graph_max_batch": 128})) == 0
    assert mixed_graph_tokens(SimpleNamespace(**{**vars(opts), "use_cuda_graphs": False})) == 0


@pytest.mark.parametrize("decode", [True, False])
def test_all_padding_batch_of_graph_capture_runs(tokenized_tiny, decode):
    """The inputs graph capture runs on (runner.fill_padding): no row has context, nothing is
    stored, every sample row draws greedily into the scratch row; the step runs on them."""
    from slipstream.runner.inputs import StepShape
    from slipstream.sampling.sampler import SamplerFlags
    llm = LLM(tokenized_tiny, device="cpu", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
    runner, slot = llm.engine.runner, llm.engine.runner.slots[0]
    T = 8 if decode else 32
    shape = StepShape.padded_to(StepPad(T, 8), decode, SamplerFlags(False, False, 0), 256)
    runner.fill_padding(slot, shape)
    h = slot.host
    assert h.query_start_loc[:9].tolist() == (list(range(9)) if decode else [0] * 9)
    assert (h.seq_lens[:8] == 0).all() and (h.slot_mapping[:T] == -1).all() and (h.carry_idx[:T] == -1).all()
    assert h.logits_indices[:8].tolist() == (list(range(8)) if decode else [0] * 8)
    assert (h.state_row[:8] == 8).all() and (h.temperature[:8] == 0).all() and (h.inv_t[:8] == 1).all()
    before = [k.clone() for k, _ in runner.kv_caches]
    runner.compute_step(slot, shape)
    assert all(torch.equal(a, k) for a, (k, _) in zip(before, runner.kv_caches))  # nothing stored
