"""Structured outputs in the engine: the deferred sampling of constrained batches (sync and async
give the same tokens), the scheduler's grammar states (compile wait, errors, preemption, n), and
the core's stats, on a tiny random Llama with the SmolLM2 tokenizer (random weights follow the
mask, so every check is on the tokens: each is one the grammar accepts)."""
import json
import threading

import pytest

from slipstream import LLM, SamplingParams, StructuredOutputsParams
from slipstream.config import STRUCTURED_OUTPUTS_BACKENDS, EngineConfig
from slipstream.core.engine_core import EngineCore
from slipstream.core.messages import AddRequest
from slipstream.sampling.grammar.backend import GRAMMAR_BACKENDS
from slipstream.sampling.grammar.matcher import GrammarMatcher

COMMON = dict(device="cpu", max_model_len=256)

# bounded everywhere, so a random model's JSON ends within max_tokens often enough
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 4},
    "kind": {"enum": ["cat", "dog"]},
    "ok": {"type": "boolean"}}, "required": ["name", "kind", "ok"]}
PAIR = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "boolean"},
                                               "maxItems": 2}}, "required": ["a"]}


def constraints():
    return [StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
            StructuredOutputsParams(json=PAIR, disable_any_whitespace=True),
            StructuredOutputsParams(regex=r"[ab]{2,6}\."),
            StructuredOutputsParams(choice=["yes", "no", "maybe"]),
            StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ")"')]


def assert_follows(llm: LLM, constraint: StructuredOutputsParams, token_ids, finish_reason) -> None:
    """Every token is one the grammar accepts; a "stop" ends a complete sentence (its stop token
    accepted last) and a "length" does not end one."""
    so = llm.engine.scheduler.structured_outputs
    matcher = GrammarMatcher(so.compiler.backend, so.compiler.submit(constraint).result())
    assert matcher.accept_many(token_ids) == len(token_ids), (constraint, token_ids)
    assert matcher.is_terminated == (finish_reason == "stop"), finish_reason


def run(llm: LLM, temperature: float):
    prompts = ["Tell me about a pet:", "List:", "Go", "Answer me", "Count:", "free text please"]
    params = [SamplingParams(max_tokens=24, temperature=temperature, seed=7 + i, structured_outputs=c)
              for i, c in enumerate(constraints())]
    params.append(SamplingParams(max_tokens=12, temperature=temperature, seed=3))  # unconstrained
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], params


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.quick_sample(1)  # the quick tier's sampled constrained rows: the preemption test's
def test_async_equals_sync_with_constrained_and_free_rows(tokenized_tiny, temperature):
    results = {}
    for async_scheduling in (False, True):
        llm = LLM(tokenized_tiny, async_scheduling=async_scheduling, **COMMON)
        results[async_scheduling], params = run(llm, temperature)
        for (tokens, reason), p in zip(results[async_scheduling], params):
            if p.structured_outputs is not None:
                assert_follows(llm, p.structured_outputs, tokens, reason)
        stats = llm.engine.stats()
        assert stats["constrained_requests"] == 5
        assert stats["grammar_compile_failed"] == 0
    assert results[True] == results[False]
    assert sum(reason == "stop" for _, reason in results[True][:5]) >= 3  # grammars do end requests


@pytest.mark.slow
@pytest.mark.parametrize("max_tokens", [20, 40])  # the quick tier runs the shorter requests
@pytest.mark.quick_sample(1)
def test_preemption_mid_constrained_request_changes_nothing(tokenized_tiny, max_tokens):
    prompts = [f"Request number {i} wants a pet record:" for i in range(6)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=11,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    outs = {}
    for name, blocks in (("roomy", None), ("small", 14)):
        llm = LLM(tokenized_tiny, async_scheduling=True, num_kv_blocks=blocks, max_num_batched_tokens=64,
                  max_num_seqs=8, block_size=8, debug_kv=True, **COMMON)
        res = llm.generate(prompts, params)
        outs[name] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in res]
        for tokens, reason in outs[name]:
            assert_follows(llm, params.structured_outputs, tokens, reason)
        if name == "small":
            assert llm.engine.scheduler.num_preemptions > 0
    assert outs["small"] == outs["roomy"]


@pytest.mark.slow  # the quick tier: llguidance in tests/test_structured_outputs_backend.py, the engine path with xgrammar
def test_the_llguidance_backend_in_the_engine(tokenized_tiny):
    """The same constraints through --structured-outputs-backend llguidance: every output
    follows its grammar (checked by llguidance's own matcher), async equals sync."""
    results = {}
    for async_scheduling in (False, True):
        llm = LLM(tokenized_tiny, async_scheduling=async_scheduling, structured_outputs_backend="llguidance",
                  **COMMON)
        results[async_scheduling], params = run(llm, 0.8)
        assert llm.engine.scheduler.structured_outputs.compiler.backend.name == "llguidance"
        for (tokens, reason), p in zip(results[async_scheduling], params):
            if p.structured_outputs is not None:
                assert_follows(llm, p.structured_outputs, tokens, reason)
        assert llm.engine.stats()["grammar_compile_failed"] == 0
    assert results[True] == results[False]
    assert sum(reason == "stop" for _, reason in results[True][:5]) >= 2


@pytest.mark.slow
def test_n_completions_each_follow_their_own_matcher(tokenized_tiny):
    llm = LLM(tokenized_tiny, **COMMON)
    params = SamplingParams(n=3, max_tokens=30, temperature=1.0, seed=5,
                            structured_outputs=StructuredOutputsParams(json=PERSON, disable_any_whitespace=True))
    (out,) = llm.generate(["Three pets:"], params)
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert_follows(llm, params.structured_outputs, c.token_ids, c.finish_reason)
        if c.finish_reason == "stop":
            assert set(json.loads(c.text)) == {"name", "kind", "ok"}
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # three draws, not one shared state


@pytest.mark.slow
def test_a_bad_schema_fails_alone(tokenized_tiny):
    llm = LLM(tokenized_tiny, **COMMON)
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"x": {"type": "nonsense"}}}))
    good = SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    outs = llm.generate(["one", "two", "three"], [bad, good, SamplingParams(max_tokens=8)])
    failed = outs[0].outputs[0]
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert "invalid JSON schema" in outs[0].error and "\n" not in outs[0].error
    assert_follows(llm, good.structured_outputs, outs[1].outputs[0].token_ids, outs[1].outputs[0].finish_reason)
    assert outs[1].outputs[0].text and set(outs[1].outputs[0].text) <= {"a", "b"}
    assert len(outs[2].outputs[0].token_ids) == 8
    assert llm.engine.stats()["grammar_compile_failed"] == 1


@pytest.mark.slow
def test_a_request_waiting_for_its_grammar_stalls_no_one(tokenized_tiny):
    # in-process matchers: with workers, "warm" would wait for their start too (seconds)
    core = EngineCore(EngineConfig(model=tokenized_tiny, structured_outputs_workers=0, **COMMON))
    release = threading.Event()
    slow_schema = {"type": "object", "properties": {"slow": {"type": "boolean"}}, "required": ["slow"]}
    core.add(AddRequest("warm", [1, 2], SamplingParams(max_tokens=1, structured_outputs={"regex": "a"}).to_dict()))
    so = core.scheduler.structured_outputs
    backend = so.compiler.backend
    compile_now = backend.compile

    def compile_slowly(key):
        if "slow" in key.spec:
            assert release.wait(30)
        return compile_now(key)

    backend.compile = compile_slowly
    slow = SamplingParams(max_tokens=30, temperature=0, structured_outputs={"json": slow_schema, "disable_any_whitespace": True})
    core.add(AddRequest("slow", [5, 6, 7], slow.to_dict()))
    core.add(AddRequest("free", [8, 9], SamplingParams(max_tokens=5, temperature=0).to_dict()))
    finished = {}
    for _ in range(40):
        finished.update({o.request_id: o for o in core.step() if o.finish_reason})
        if "free" in finished and "warm" in finished:
            break
    assert "free" in finished and "slow" not in finished
    assert core.scheduler.waiting[0].request_id == "slow" and core.scheduler.waiting[0].awaiting_grammar
    release.set()
    tokens = []
    while core.has_work():
        for o in core.step():
            if o.request_id == "slow":
                tokens += o.new_token_ids
                if o.finish_reason:
                    finished["slow"] = o
    assert finished["slow"].finish_reason == "stop"
    assert tokens[-1] == finished["slow"].stop_token  # (the tiny model's EOS is a text token)
    text = core_text(tokenized_tiny, tokens[:-1])
    assert json.loads(text).keys() == {"slow"}
    core.close()


def core_text(folder: str, tokens) -> str:
    from slipstream.model.tokenizer import load_tokenizer
    return load_tokenizer(folder).decode(tokens)


def test_an_engine_without_a_tokenizer_fails_constrained_requests_alone(tokenized_tiny):
    llm = LLM(tokenized_tiny, load_format="dummy", **COMMON)
    outs = llm.generate([[1, 2, 3], [4, 5]], [
        SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+")),
        SamplingParams(max_tokens=4, ignore_eos=True)])
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[0].error == ("structured outputs are unavailable: the engine has no tokenizer to build "
                             "token masks from (load_format='dummy' loads none)")
    assert len(outs[1].outputs[0].token_ids) == 4


def test_the_option_names_the_backends_there_are():
    assert set(STRUCTURED_OUTPUTS_BACKENDS) == set(GRAMMAR_BACKENDS)
    with pytest.raises(ValueError, match="structured_outputs_backend"):
        EngineConfig(structured_outputs_backend="outlines")


def test_unconstrained_batches_keep_their_path(tokenized_tiny):
    llm = LLM(tokenized_tiny, **COMMON)
    llm.generate(["hello"], SamplingParams(max_tokens=4))
    assert llm.engine.scheduler.structured_outputs.compiler is None  # no grammar library loaded
    assert llm.engine.runner.slots[0]._bitmask is None  # nor a bitmask allocated
    assert llm.engine.loop.deferred is None


def test_the_constrained_bench_workloads_and_their_grammar_line():
    from slipstream.bench.run import compile_line, grammar_line, grammar_summary
    from slipstream.bench.workloads import BENCH_SCHEMA, get_workload
    from slipstream.core.tracing import Timeline
    for name, parent, count in (("small-256-json", "small-256", 256), ("small-256-json-half", "small-256", 128),
                                ("seed-8b-short-json", "seed-8b-short", 32),
                                ("seed-8b-short-json-half", "seed-8b-short", 16)):
        w, base = get_workload(name), get_workload(parent)
        constrained = [p.structured_outputs for p in w.params if p.structured_outputs is not None]
        assert len(constrained) == count and all(c.json == BENCH_SCHEMA for c in constrained)
        if count < len(w.params):  # spread evenly: every other request
            assert [p.structured_outputs is not None for p in w.params[:4]] == [False, True, False, True]
        assert [p.clone(structured_outputs=None) for p in w.params] == base.params
        assert w.prompts == base.prompts and w.engine == base.engine
    tl = Timeline()
    tl.cpu("grammar", 1.0, 1.002, 3)
    tl.cpu("grammar", 2.0, 2.004, 4)
    tl.cpu("process", 2.0, 2.5, 4)
    assert grammar_line(tl, 4, 8) == "4 of 8 requests constrained; grammar CPU 3.000 ms per constrained step over 2 steps"
    stats = {"grammar_compiled": 2, "grammar_compile_seconds": 0.017, "grammar_cache_hits": 30,
             "grammar_compile_failed": 0}
    assert compile_line(stats) == "grammar compile: 2 cold, 8.5 ms each; 30 cache hits, 0 failed"
    summary = grammar_summary({"async": tl}, 4, stats)
    assert summary["modes"]["async"] == {"grammar_cpu_ms_per_step": pytest.approx(3.0), "constrained_steps": 2}
    assert summary["constrained_requests"] == 4 and summary["grammar_cache_hits"] == 30


@pytest.mark.slow
def test_a_constrained_row_forbids_the_ids_past_the_tokenizer(tokenized_tiny):
    from slipstream.model.tokenizer import load_tokenizer
    from slipstream.sampling.grammar.backend import create_grammar_backend
    from slipstream.sampling.grammar.bitmask import allocate_bitmask, allowed_token_ids
    from slipstream.sched.request import Request
    from slipstream.sched.structured_outputs import StructuredOutputs
    hf = load_tokenizer(tokenized_tiny).hf
    vocab = len(hf) + 100  # the model's logits are wider than the tokenizer (padded vocabularies)
    so = StructuredOutputs(lambda: create_grammar_backend("xgrammar", hf, vocab, [2]))
    req = Request("r", [1], SamplingParams(structured_outputs={"regex": ".{1,5}"}), 0)
    assert so.submit(req) is None and req.awaiting_grammar
    req.grammar.result()
    assert so.poll() == [] and not req.awaiting_grammar
    bitmask = allocate_bitmask(1, vocab)
    so.fill_token_bitmask([req], bitmask)
    allowed = allowed_token_ids(bitmask, 0, vocab)
    assert len(allowed) > 1000 and int(allowed.max()) < len(hf)
    assert so.stats().constrained_requests == 1 and so.stats().grammar_cpu_seconds > 0
    so.close()


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.quick_sample(1)  # the quick tier's async constrained rows: async = sync above
def test_the_grammar_wins_over_min_tokens(tokenized_tiny, async_scheduling):
    """min_tokens keeps a constrained row from stopping while its grammar allows anything
    else; once the grammar allows only its stop token, the request ends "stop" there."""
    llm = LLM(tokenized_tiny, async_scheduling=async_scheduling, **COMMON)
    done = SamplingParams(max_tokens=20, min_tokens=10, temperature=0,
                          structured_outputs=StructuredOutputsParams(choice=["yes"]))
    longer = SamplingParams(max_tokens=20, min_tokens=6, temperature=0.8, seed=1,
                            structured_outputs=StructuredOutputsParams(regex=r"a{1,3}( a{1,3})*"))
    free = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)
    outs = llm.generate(["one", "two", "three"], [done, longer, free])
    first = outs[0].outputs[0]
    assert (first.text, first.finish_reason) == ("yes", "stop") and outs[0].error is None
    second = outs[1].outputs[0]
    assert len(second.token_ids) >= 6 and second.finish_reason in ("stop", "length")
    assert_follows(llm, longer.structured_outputs, second.token_ids, second.finish_reason)
    assert len(outs[2].outputs[0].token_ids) == 8


def test_min_tokens_in_a_constrained_batch_is_in_the_bitmask(tokenized_tiny):
    """A constrained batch's bitmask is written whole: its free and padding rows all allowed;
    its min_tokens rows masked there (its logits are not touched): a free row loses its stop
    tokens, a constrained row too unless they are all its grammar allows."""
    from slipstream.model.tokenizer import load_tokenizer
    from slipstream.sampling.grammar.backend import create_grammar_backend
    from slipstream.sampling.grammar.bitmask import allocate_bitmask, allowed_token_ids
    from slipstream.sched.request import Request
    from slipstream.sched.structured_outputs import StructuredOutputs
    hf = load_tokenizer(tokenized_tiny).hf
    vocab, eos = len(hf), 2
    so = StructuredOutputs(lambda: create_grammar_backend("xgrammar", hf, vocab, [eos]))
    free = Request("free", [1], SamplingParams(), 0)
    ended = Request("ended", [1], SamplingParams(structured_outputs={"choice": ["yes"]}), 0)
    going = Request("going", [1], SamplingParams(structured_outputs={"regex": "(yes)+"}), 0)
    for req in (ended, going):
        assert so.submit(req) is None
        req.grammar.result()
    assert so.poll() == []
    yes = hf.encode("yes", add_special_tokens=False)
    assert ended.matcher.accept_many(yes) == len(yes) and going.matcher.accept_many(yes) == len(yes)
    bitmask = allocate_bitmask(4, vocab).zero_()  # stale rows: every row is written
    so.fill_token_bitmask([free, ended, going], bitmask, [(0, [eos, 7]), (1, [eos]), (2, [eos])])
    assert (bitmask[3] == -1).all()  # a padding row: all allowed
    assert allowed_token_ids(bitmask, 0, vocab).tolist() == [t for t in range(vocab) if t not in (eos, 7)]
    assert allowed_token_ids(bitmask, 1, vocab).tolist() == [eos]  # the grammar can only stop
    going_ids = allowed_token_ids(bitmask, 2, vocab).tolist()
    assert eos not in going_ids and going_ids
    so.close()
