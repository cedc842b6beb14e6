"""Structured outputs with the matchers in grammar worker processes (--structured-outputs-workers):
the same tokens as in-process matchers (greedy and seeded, async and sync, with preemption), a
bad schema failing alone, a worker's death failing its requests alone, and no process outliving
the engine. The step of one worker is checked in-process against a plain matcher first."""
import os
import signal

import pytest
import torch
from test_structured_outputs_engine import COMMON, PERSON, assert_follows, constraints

from slipstream import LLM, SamplingParams, StructuredOutputsParams
from slipstream.config import EngineConfig
from slipstream.core.messages import AddRequest
from slipstream.sampling.grammar.bitmask import allocate_bitmask
from slipstream.sampling.grammar.compiler import GrammarCompiler
from slipstream.sampling.grammar.matcher import GrammarMatcher
from slipstream.sampling.grammar.worker_main import GrammarWorkerState
from slipstream.sampling.grammar.worker_messages import AddGrammar, Step

PROMPTS = ["Tell me about a pet:", "Go", "Answer me", "free text please",
           "Request number 6 wants a pet record:", "Request number 7 wants a pet record:"]


def params(temperature: float) -> list[SamplingParams]:
    """Three grammars (a JSON schema, a regex, a choice), a free row, and two more rows of the
    schema (its compile cached); the quick tier's budget keeps the grammars few."""
    person, regex, choice = (constraints()[i] for i in (0, 2, 3))
    ps = [SamplingParams(max_tokens=24, temperature=temperature, seed=7 + i, structured_outputs=c)
          for i, c in enumerate((person, regex, choice))]
    ps.append(SamplingParams(max_tokens=12, temperature=temperature, seed=3))  # free
    ps += [SamplingParams(max_tokens=24, temperature=temperature, seed=20 + i,
                          structured_outputs=person) for i in range(2)]
    return ps


def results(llm: LLM, temperature: float):
    outs = llm.generate(PROMPTS, params(temperature))
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


@pytest.fixture(scope="module")
def engines(tokenized_tiny):
    made = {
        "in-process": LLM(tokenized_tiny, async_scheduling=True, structured_outputs_workers=0, **COMMON),
        # little KV: requests are preempted mid-output and recomputed; the tests switch it
        # between async and sync (one engine: its workers start once)
        "workers": LLM(tokenized_tiny, async_scheduling=True, structured_outputs_workers=2,
                       num_kv_blocks=10, max_num_batched_tokens=64, max_num_seqs=8, block_size=8,
                       debug_kv=True, **COMMON),
    }
    for llm in made.values():
        # Workers up and every grammar compiled first: a request is scheduled once its grammar
        # is ready, so the compared runs all admit their requests together in every engine.
        llm.generate(PROMPTS[:3], [SamplingParams(max_tokens=2, structured_outputs=p.structured_outputs)
                                   for p in params(0.0)[:3]])
    yield made
    for llm in made.values():
        llm.engine.close()


def test_the_default_worker_count_and_the_option():
    assert EngineConfig().structured_outputs_workers == 0  # in-process unless asked
    assert EngineConfig(structured_outputs_workers=3).structured_outputs_workers == 3
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="structured_outputs_workers must be a non-negative integer"):
            EngineConfig(structured_outputs_workers=bad)


@pytest.mark.slow
def test_a_worker_step_writes_the_rows_of_plain_matchers(tokenized_tiny):
    """One worker's state, in-process: the rows it writes after accepting tokens are those of
    matchers that accepted the same tokens; a rejected token fails its request alone."""
    llm = LLM(tokenized_tiny, structured_outputs_workers=0, **COMMON)
    llm.generate(["warm"], SamplingParams(max_tokens=1, structured_outputs=constraints()[0]))
    backend = llm.engine.scheduler.structured_outputs.compiler.backend
    state = GrammarWorkerState(GrammarCompiler(backend))
    person, regex = constraints()[0], constraints()[2]
    for gid, c in ((0, person), (1, regex), (2, regex)):
        state.add(AddGrammar(gid, *c.key()))
    text = backend.tokenizer_info.decoded_vocab
    first = next(t for t, s in enumerate(text) if s == b'{"')
    ab = [t for t, s in enumerate(text) if s in (b"ab", b"a")][:2]
    got = allocate_bitmask(4, backend.vocab_size)
    done = state.step(Step([], [(0, [first]), (1, ab), (2, [first])], [(0, 0), (1, 1), (2, 2)], "", 0, 0), got)
    assert done.errors == [(2, f"the sampled token {first} does not follow the request's grammar")]
    want = allocate_bitmask(4, backend.vocab_size)
    for row, (c, tokens) in enumerate(((person, [first]), (regex, ab))):
        m = GrammarMatcher(backend, backend.compile(c.key()))
        assert m.accept_many(tokens) == len(tokens)
        m.fill_bitmask(want, row)
    assert torch.equal(got[:2], want[:2])
    assert (got[2] == -1).all()  # the failed request's row allows everything
    state.step(Step([0, 1, 2], [], [], "", 0, 0), got)
    assert not state.matchers and not state.handles and not state.failed
    state.compiler.close()


@pytest.mark.subprocess  # the grammar workers are processes
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_workers_give_the_tokens_of_in_process_matchers(engines, temperature):
    want = results(engines["in-process"], temperature)
    llm = engines["workers"]
    so = llm.engine.scheduler.structured_outputs
    preemptions = llm.engine.stats()["num_preemptions"]
    for async_scheduling in (True, False):
        llm.engine.set_async_scheduling(async_scheduling)
        got = results(llm, temperature)
        assert got == want, async_scheduling
        assert len(so.worker_pids) == 2
        for (tokens, reason), p in zip(got, params(temperature)):
            if p.structured_outputs is not None:
                assert_follows(llm, p.structured_outputs, tokens, reason)
    llm.engine.set_async_scheduling(True)
    assert llm.engine.stats()["num_preemptions"] > preemptions
    assert sum(reason == "stop" for _, reason in want) >= 2  # grammars do end requests


@pytest.mark.subprocess  # the grammar workers are processes
def test_a_bad_schema_fails_alone_with_workers(engines):
    llm = engines["workers"]
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"x": {"type": "nonsense"}}}))
    good = SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    outs = llm.generate(["one", "two", "three"], [bad, good, SamplingParams(max_tokens=8)])
    assert outs[0].outputs[0].finish_reason == "error" and outs[0].outputs[0].token_ids == []
    assert "invalid JSON schema" in outs[0].error and "\n" not in outs[0].error
    assert outs[1].outputs[0].text and set(outs[1].outputs[0].text) <= {"a", "b"}
    assert len(outs[2].outputs[0].token_ids) == 8


@pytest.mark.subprocess  # the grammar workers are processes
def test_a_dead_worker_fails_its_requests_alone(engines):
    core = engines["workers"].engine
    so = core.scheduler.structured_outputs
    schema = {"json": PERSON}
    for i in range(4):
        core.add(AddRequest(f"r{i}", [5 + i, 6, 7], SamplingParams(
            max_tokens=40, temperature=0.8, seed=i, structured_outputs=schema).to_dict()))
    core.add(AddRequest("free", [8, 9], SamplingParams(max_tokens=30, ignore_eos=True).to_dict()))
    finished, steps = {}, 0
    while core.has_work():
        steps += 1
        if steps == 4:
            victim = so.workers.pool.slots[0]
            os.kill(victim.process.pid, signal.SIGKILL)
        finished.update({o.request_id: o for o in core.step() if o.finish_reason})
    errors = {rid: o.error for rid, o in finished.items() if o.finish_reason == "error"}
    assert errors and set(errors) <= {"r0", "r1", "r2", "r3"}, finished
    assert all(e.startswith("the structured-outputs worker process 0 (pid") and "died (exit code -9)" in e
               for e in errors.values()), errors
    assert finished["free"].finish_reason == "length" and len(finished) == 5
    # the next request for that slot starts a fresh worker (not waited for here: the next test
    # closes it with the engine)
    core.add(AddRequest("again", [5], SamplingParams(max_tokens=4, structured_outputs=schema).to_dict()))
    fresh = so.workers.pool.slots[0]
    assert fresh is not victim and fresh.error is None and fresh.alive()
    core.abort(["again"])
    while core.has_work():
        core.step()


@pytest.mark.subprocess  # the grammar workers are processes
def test_no_worker_outlives_the_engine(engines):
    llm = engines["workers"]
    pool = llm.engine.scheduler.structured_outputs.workers.pool
    pids = pool.pids
    live = [w for w in pool.slots if w is not None and w.ready and w.error is None]
    # a worker whose pipe closes (the core's process died) exits by itself, cleanly
    live[0].conn.close()
    assert live[0].process.wait(30) == 0
    llm.engine.close()
    assert pool.pids == []
    for pid in pids:  # (Popen.wait reaped each: the pid is gone)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_workers_on_the_gpu_give_the_tokens_of_in_process_matchers(tokenized_tiny, async_scheduling):
    """Under CUDA graphs (split constrained steps), 4 workers against in-process matchers."""
    got = {}
    for workers in (0, 4):
        llm = LLM(tokenized_tiny, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8,
                  async_scheduling=async_scheduling, structured_outputs_workers=workers)
        llm.generate(PROMPTS[:3], [SamplingParams(max_tokens=2, structured_outputs=p.structured_outputs)
                                   for p in params(0.0)[:3]])  # workers up, grammars compiled
        got[workers] = [results(llm, t) for t in (0.0, 0.8)]
        assert len(llm.engine.scheduler.structured_outputs.worker_pids) == workers
        llm.engine.close()
        del llm
        torch.cuda.empty_cache()
    assert got[4] == got[0]


@pytest.mark.slow
def test_the_worker_spec_is_files_not_pickles(tokenized_tiny, tmp_path):
    """A worker's backend inputs cross the process boundary as the tokenizer's own files and
    JSON: the tokenizer read back has the same vocabulary and special tokens."""
    import json

    from transformers import AutoTokenizer

    from slipstream.model.tokenizer import load_tokenizer
    from slipstream.sampling.grammar.worker_pool import GrammarWorkerSpec, write_spec
    hf = load_tokenizer(tokenized_tiny).hf
    path = write_spec(str(tmp_path), GrammarWorkerSpec("xgrammar", hf, 512, (2, 3)), batch_threads=2)
    spec = json.loads(open(path).read())
    assert spec == {"backend": "xgrammar", "tokenizer": str(tmp_path / "tokenizer"), "vocab_size": 512,
                    "stop_token_ids": [2, 3], "batch_threads": 2}
    assert not [p for p in tmp_path.rglob("*") if p.suffix in (".pickle", ".pkl")]
    back = AutoTokenizer.from_pretrained(spec["tokenizer"])
    assert back.get_vocab() == hf.get_vocab()
    assert back.all_special_ids == hf.all_special_ids
