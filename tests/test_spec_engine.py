"""Speculative decoding inside the engine (n-gram drafts): greedy output token-identical to
speculation off, sync and async, with drafts actually accepted; stop tokens, max_tokens and
rows that may not draft keep their meaning; the stats count drafts."""
import pytest

from slipstream import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _prompts():
    """Prompts that repeat themselves, so the n-gram lookup finds continuations."""
    return [[5, 6, 7, 8, 9, 10] * 5, [40, 41, 42] * 7 + [40], [3, 1, 4, 1, 5, 9, 2, 6] * 3, [100, 101, 102, 103]]


def _run(folder, prompts, params, **kw):
    llm = LLM(folder, device="cpu", max_model_len=256, max_num_seqs=8, debug_kv=True, **kw)
    outs = llm.generate(prompts, params)
    return llm, [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_ngram_equals_plain_decoding(tiny_model, async_scheduling):
    folder, _ = tiny_model("llama")
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    _, plain = _run(folder, _prompts(), params, async_scheduling=async_scheduling)
    llm, spec = _run(folder, _prompts(), params, async_scheduling=async_scheduling, speculative_config=NGRAM)
    assert spec == plain
    stats = llm.engine.stats() if hasattr(llm.engine, "stats") else llm.engine.core.stats()
    assert stats["spec_num_draft_tokens"] > 0
    assert stats["spec_num_accepted_tokens"] > 0, stats  # not vacuous: some drafts were accepted
    assert 1.0 < stats["spec_mean_accepted_length"] <= 4.0
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks  # nothing leaked


@pytest.mark.slow
def test_stops_and_max_tokens_cut_the_accepted_drafts(tiny_model):
    """A stop token or max_tokens inside an accepted run of drafts ends the request there."""
    folder, _ = tiny_model("llama")
    prompts = _prompts()
    _, full = _run(folder, prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    for i, (tokens, _) in enumerate(full):
        stop = tokens[7]
        params = [SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop]),
                  SamplingParams(max_tokens=5 + i, temperature=0, ignore_eos=True)]
        for p in params:
            _, plain = _run(folder, [prompts[i]], p)
            llm, spec = _run(folder, [prompts[i]], p, speculative_config=NGRAM)
            assert spec == plain
            assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_rows_that_may_not_draft_keep_their_meaning(tiny_model, async_scheduling):
    """min_tokens rows run without drafts beside drafting rows; rows with penalties draft
    (each position penalised by the drafts before it); a row asking for logprobs drafts and
    gets the logprobs (and top-k) of each emitted token."""
    folder, _ = tiny_model("llama")
    prompts = _prompts()
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=20, temperature=0, min_tokens=10, stop_token_ids=[7]),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)]
    common = dict(device="cpu", max_model_len=256, max_num_seqs=8, async_scheduling=async_scheduling)
    plain = LLM(folder, **common).generate(prompts, params)
    llm = LLM(folder, speculative_config=NGRAM, **common)
    spec = llm.generate(prompts, params)
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    def rounded(out):
        return [{t: round(v, 4) for t, v in entry.items()} for entry in out.outputs[0].logprobs]

    assert len(spec[1].outputs[0].logprobs) == 20 and rounded(spec[1]) == rounded(plain[1])
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0


def test_disable_by_batch_size(tiny_model):
    folder, _ = tiny_model("llama")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    cfg = dict(NGRAM, disable_by_batch_size=2)
    llm, spec = _run(folder, _prompts(), params, speculative_config=cfg)
    _, plain = _run(folder, _prompts(), params)
    assert spec == plain
    assert llm.engine.stats()["spec_num_draft_tokens"] == 0  # four rows: never drafted
    llm, _ = _run(folder, _prompts()[:2], params, speculative_config=cfg)
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0


def test_speculation_off_adds_no_stats(tiny_model):
    folder, _ = tiny_model("llama")
    llm, _ = _run(folder, _prompts()[:1], SamplingParams(max_tokens=4, temperature=0))
    assert not any(k.startswith("spec_") for k in llm.engine.stats())


SMOL_COPY = ("Copy the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape.\n"
             "Copy: apple, banana, cherry, date, elderberry, fig, grape.\nList: red, green, blue, "
             "yellow, purple.\nCopy:")
SMOL_PARAMS = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=3)
# penalties light enough that the copy goes on: the drafts before a position count
SMOL_PENALISED = [SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, frequency_penalty=0.3,
                                 presence_penalty=0.2),
                  SamplingParams(max_tokens=32, temperature=0.7, seed=5, ignore_eos=True,
                                 repetition_penalty=1.1)]


@pytest.fixture(scope="module")
def smollm2_plain():
    """Plain decoding's outputs, once for both loops: plain decoding gives the same tokens sync
    and async (tests/test_async_llm.py, test_gemma3.py), so each loop's speculation is checked
    against the one reference and the module builds one plain SmolLM2 engine, not two."""
    plain_llm = LLM(None, device="cpu", max_model_len=512, max_num_seqs=4, async_scheduling=False)
    plain = plain_llm.generate([SMOL_COPY], SMOL_PARAMS)[0].outputs[0]
    plain_penalised = [o.outputs[0].token_ids for o in plain_llm.generate([SMOL_COPY] * 2, SMOL_PENALISED)]
    plain_llm.shutdown()
    return plain, plain_penalised


@pytest.mark.slow  # (11 s each; the quick tier keeps the tiny models' greedy equality)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_smollm2_greedy_ngram_equals_plain_and_accepts_drafts(smollm2_plain, async_scheduling):
    """The real SmolLM2 (embedded GGUF) copying lists it was given: prompt lookup drafts the
    copies, many drafts are accepted, the tokens are those of plain decoding."""
    prompt, params, penalised = SMOL_COPY, SMOL_PARAMS, SMOL_PENALISED
    common = dict(device="cpu", max_model_len=512, max_num_seqs=4, async_scheduling=async_scheduling)
    plain, plain_penalised = smollm2_plain
    llm = LLM(None, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                        "prompt_lookup_max": 4, "prompt_lookup_min": 2}, **common)
    before = llm.engine.stats()["spec_num_accepted_tokens"]
    assert [o.outputs[0].token_ids for o in llm.generate([prompt] * 2, penalised)] == plain_penalised
    assert llm.engine.stats()["spec_num_accepted_tokens"] > before  # drafts accepted under penalties
    llm.engine.scheduler.speculative.stats.__init__()  # (the counts below are the next run's)
    spec = llm.generate([prompt], params)[0].outputs[0]
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    # the logprobs of accepted drafts too: the token's and the top 3, as plain decoding's
    for got, want in zip(spec.logprobs, plain.logprobs, strict=True):
        assert list(got) == list(want)
        assert all(abs(got[t] - want[t]) < 1e-3 for t in want)
    stats = llm.engine.stats()
    assert stats["spec_num_accepted_tokens"] >= 12, stats
    assert stats["spec_mean_accepted_length"] > 2.0, stats


@pytest.mark.slow
def test_sampled_rows_equal_plain_sampling_under_the_same_seed(tiny_model):
    """n-gram drafts are a point mass: a row accepts a draft iff the target's own seeded draw
    at that position is the draft, so temperature, top-k, top-p and min-p rows give the
    tokens of plain sampling with the same seed (and a seeded run repeats itself)."""
    folder, _ = tiny_model("llama")
    prompts = _prompts()
    params = [SamplingParams(max_tokens=30, temperature=0.7, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=1.0, top_k=5, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.8, top_p=0.8, min_p=0.05, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.5, seed=4, ignore_eos=True)]
    common = dict(device="cpu", max_model_len=256, max_num_seqs=8)
    plain = [o.outputs[0].token_ids for o in LLM(folder, **common).generate(prompts, params)]
    for async_scheduling in (False, True):
        llm = LLM(folder, speculative_config=NGRAM, async_scheduling=async_scheduling, **common)
        spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert spec == plain
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert again == plain
        assert llm.engine.stats()["spec_num_accepted_tokens"] > 0


def test_metrics_and_bench_read_the_speculation_counters(tiny_model):
    """/metrics exposes the engine's speculation counters; `slipstream bench` reports a run's."""
    from slipstream.bench.throughput import speculation_summary
    from slipstream.server.metrics import ServerMetrics

    folder, _ = tiny_model("llama")
    llm, _ = _run(folder, _prompts()[:2], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                  speculative_config=NGRAM)
    stats = llm.engine.stats()
    text = ServerMetrics("m").render(stats).decode()
    accepted = stats["spec_num_accepted_tokens"]
    assert f'slipstream:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(accepted)}' in text
    assert "slipstream:spec_decode_num_draft_tokens_total" in text
    assert "slipstream:spec_decode_mean_accepted_length" in text
    assert "spec_decode" not in ServerMetrics("m").render({"num_running": 0}).decode()
    summary = speculation_summary({}, stats, steps=50)
    assert summary["accepted"] == accepted and summary["drafted"] == stats["spec_num_draft_tokens"]
    assert summary["mean_accepted_length"] == stats["spec_mean_accepted_length"] >= 1.0
    assert speculation_summary(stats, stats, 3)["drafted"] == 0
    assert speculation_summary({}, {"num_running": 0}, 3) == {}


@pytest.mark.slow
def test_mixed_workload_with_preemption_prefix_hits_and_stop_strings(tokenized_tiny):
    """The async-equivalence mix (stop strings, EOS, seeds, temperatures, shared prefixes,
    staggered arrivals, aborts) in a KV cache small enough to preempt: with n-gram speculation
    every request that was not aborted gets plain decoding's tokens, text and finish reason."""
    from async_mix import mix, run_mix

    reqs = mix(tokenized_tiny)
    common = dict(device="cpu", max_model_len=256, num_kv_blocks=24, max_num_batched_tokens=64,
                  max_num_seqs=12, debug_kv=True)
    plain = run_mix(LLM(tokenized_tiny, async_scheduling=False, **common), reqs)
    aborted = {rid for rid, (_, _, reason) in plain.items() if reason == "abort"}
    for async_scheduling in (False, True):
        llm = LLM(tokenized_tiny, async_scheduling=async_scheduling, speculative_config=NGRAM, **common)
        got = run_mix(llm, reqs)
        assert {r: v for r, v in got.items() if r not in aborted and v[2] != "abort"} == \
            {r: v for r, v in plain.items() if r not in aborted and r in got and got[r][2] != "abort"}
        assert len(got) == len(plain)
        stats = llm.engine.stats()
        assert stats["spec_num_accepted_tokens"] > 0 and llm.engine.scheduler.num_preemptions > 0
        while llm.engine.has_work():  # a step drawn past a request's end may still be in flight
            llm.engine.step()
        assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


@pytest.mark.slow
def test_a_grammar_turns_drafting_off_and_keeps_its_meaning(tokenized_tiny):
    """A constrained request arriving while rows draft (sync and async: rows still to be
    shifted on the GPU) follows its grammar, and every request gets plain decoding's tokens."""
    from slipstream import StructuredOutputsParams

    free = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=24, temperature=0,
                                 structured_outputs=StructuredOutputsParams(regex=r"[ab]{2,6}\."))

    def run(llm):
        for i, prompt in enumerate(_prompts()[:3]):
            llm.add_request(prompt, free, request_id=f"free{i}")
        done, step = {}, 0
        while llm.has_unfinished_requests() or step < 4:
            if step == 3:
                llm.add_request("Answer me", constrained, request_id="json")
            for out in llm.step():
                if out.finished:
                    done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
            step += 1
        return done

    common = dict(device="cpu", max_model_len=256, max_num_seqs=8)
    plain = run(LLM(tokenized_tiny, **common))
    for async_scheduling in (False, True):
        llm = LLM(tokenized_tiny, async_scheduling=async_scheduling, speculative_config=NGRAM, **common)
        assert run(llm) == plain
        assert llm.engine.stats()["spec_num_draft_tokens"] > 0
        assert llm.engine.stats()["constrained_requests"] == 1


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_drafting_starts_when_the_batch_shrinks(tiny_model, async_scheduling):
    """disable_by_batch_size=2 with four requests of different lengths: the first steps run
    plain (graph-shaped, no drafts), drafting starts once two requests remain (async: device
    histories reset from the host's tokens), and the tokens are plain decoding's."""
    folder, _ = tiny_model("llama")
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (6, 12, 30, 40)]
    cfg = dict(NGRAM, disable_by_batch_size=2)
    _, plain = _run(folder, _prompts(), params, async_scheduling=async_scheduling)
    llm, spec = _run(folder, _prompts(), params, async_scheduling=async_scheduling, speculative_config=cfg)
    assert spec == plain
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0


@pytest.mark.slow  # a bench run of two engines
def test_bench_takes_the_speculative_config_flag(tiny_model, tmp_path, monkeypatch, capsys):
    """`slipstream bench --speculative-config` runs both modes with identical outputs and reports
    the drafts; a bad value is a one-line error (exit 2)."""
    import json

    from slipstream.bench import workloads
    from slipstream.cli.main import main

    folder, _ = tiny_model("llama")
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) for _ in _prompts()]
    monkeypatch.setitem(workloads.WORKLOADS, "spec-unit", lambda: workloads.Workload(
        "spec-unit", folder, _prompts(), params, dict(max_num_seqs=4, max_model_len=128)))
    flag = json.dumps(NGRAM)
    assert main(["bench", "--workload", "spec-unit", "--device", "cpu", "--speculative-config", flag,
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "identical outputs: True" in out and "async: speculation:" in out and "sync: speculation:" in out
    summary = json.loads((tmp_path / "spec-unit.json").read_text())
    for mode in ("sync", "async"):
        s = summary["results"][mode]["speculation"]
        assert s["drafted"] > 0 and s["accepted"] <= s["drafted"] and s["steps_with_drafts"] <= s["steps"]
    assert main(["bench", "--workload", "spec-unit", "--device", "cpu", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 99}']) == 2
    assert "num_speculative_tokens must be an integer in [1, 16]" in capsys.readouterr().err


def test_a_model_that_is_not_an_eagle3_head_is_refused(tiny_model):
    folder, _ = tiny_model("llama")
    with pytest.raises(ValueError, match="the head expects"):
        LLM(folder, device="cpu", max_model_len=64,
            speculative_config={"method": "eagle3", "model": folder, "num_speculative_tokens": 2})


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_rows_at_the_end_of_the_context(tiny_model, async_scheduling):
    """Requests that run up to max_model_len: drafts (and, async, the KV reserved for a shift)
    never reach past the context, and the tokens are plain decoding's."""
    folder, _ = tiny_model("llama")
    prompts = _prompts()
    params = [SamplingParams(max_tokens=64 - len(p), temperature=0, ignore_eos=True) for p in prompts]
    kw = dict(async_scheduling=async_scheduling, max_num_batched_tokens=64)
    llm = LLM(folder, device="cpu", max_model_len=64, max_num_seqs=8, debug_kv=True, **kw)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm = LLM(folder, device="cpu", max_model_len=64, max_num_seqs=8, debug_kv=True, speculative_config=NGRAM, **kw)
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert spec == plain and [len(t) for t in spec] == [p.max_tokens for p in params]
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0
