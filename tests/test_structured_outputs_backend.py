"""Structured outputs' grammar backends, on the CPU with SmolLM2's real tokenizer: the xgrammar
and llguidance backends, each through the same cases (JSON schema, regex, choice, EBNF / Lark,
json_object; structural tags, which only xgrammar takes),
GrammarMatcher (accept, rollback, bitmask, EOS), the batch helpers, GrammarCompiler (threads,
cache, errors). The request parameter: test_structured_outputs_params.py; the bitmask
helpers: test_grammar_bitmask.py."""
from __future__ import annotations

import json
import random
import threading

import pytest
import torch

from slipstream.sampling.grammar.backend import create_grammar_backend
from slipstream.sampling.grammar.bitmask import (
    allocate_bitmask,
    allowed_token_ids,
    apply_bitmask_ref,
)
from slipstream.sampling.grammar.compiler import GrammarCompiler
from slipstream.sampling.grammar.matcher import GrammarMatcher, accept_tokens, fill_bitmasks
from slipstream.sampling.structured import GrammarKey, StructuredOutputsParams

# the backend takes ~3-5 s to build on the 2-core CI machine (SmolLM2's tokenizer, twice
# xgrammar's tokenizer info)
pytestmark = pytest.mark.slow

TOKENIZER_VOCAB = 49152
PADDED_VOCAB = TOKENIZER_VOCAB + 40  # a logits width past the tokenizer's vocabulary
EOS = 2  # <|im_end|>
IM_START = 1

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "role": {"enum": ["admin", "user"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
}
PERSON = {"name": "Alice", "age": 30, "score": 0.5, "role": "admin",
          "address": {"city": "Paris", "zip": "75001"}, "tags": ["a", "b"]}


@pytest.fixture(scope="session")
def tokenizer():
    from slipstream.model.tokenizer import load_tokenizer
    return load_tokenizer(None)


@pytest.fixture(scope="session", params=["xgrammar", "llguidance"])
def backend(tokenizer, request):
    """Each backend in turn: every test on a backend runs the same cases through both."""
    return create_grammar_backend(request.param, tokenizer.hf, PADDED_VOCAB,
                                  sorted(tokenizer.eos_token_ids))


@pytest.fixture(scope="session")
def compiler(backend):
    with GrammarCompiler(backend) as grammar_compiler:
        yield grammar_compiler


def matcher_for(compiler, **constraint) -> GrammarMatcher:
    return compiler.new_matcher(compiler.submit(StructuredOutputsParams(**constraint)))


def walk(matcher: GrammarMatcher, tokenizer, text: str) -> int:
    """Accepts `text`'s tokens; returns how many were accepted."""
    return matcher.accept_many(tokenizer.encode(text))


def accepts_fully(matcher: GrammarMatcher, tokenizer, text: str) -> bool:
    ids = tokenizer.encode(text)
    return walk(matcher, tokenizer, text) == len(ids) and matcher.accepts_eos


# ---------------------------------------------------------------- JSON schema
def test_json_schema_walk_accepts_masks_and_terminates(compiler, tokenizer, backend):
    matcher = matcher_for(compiler, json=PERSON_SCHEMA)
    ids = tokenizer.encode(json.dumps(PERSON))
    bitmask = allocate_bitmask(1, backend.vocab_size)
    for token_id in ids:
        matcher.fill_bitmask(bitmask, 0)
        allowed = set(allowed_token_ids(bitmask, 0, backend.vocab_size).tolist())
        assert token_id in allowed
        assert EOS not in allowed and not matcher.accepts_eos
        assert IM_START not in allowed and max(allowed) < TOKENIZER_VOCAB
        assert matcher.accept(token_id)
    assert matcher.accepts_eos and not matcher.is_terminated
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_token_ids(bitmask, 0, backend.vocab_size).tolist() == [EOS]
    assert matcher.accept(EOS) and matcher.is_terminated and not matcher.accepts_eos
    assert not matcher.accept(ids[0])


@pytest.mark.parametrize("change", [
    {"age": 130}, {"role": "guest"}, {"name": "alice"}, {"tags": []},
    {"address": {"city": "Paris", "zip": "7500a"}}, {"score": 1.5}, {"extra": 1},
])
def test_json_schema_rejects_invalid_documents(compiler, tokenizer, change):
    document = json.dumps({**PERSON, **change})
    ids = tokenizer.encode(document)
    assert walk(matcher_for(compiler, json=PERSON_SCHEMA), tokenizer, document) < len(ids)


def test_json_schema_requires_required_fields(compiler, tokenizer):
    text = '{"name": "Alice", "age": 30}'
    matcher = matcher_for(compiler, json=PERSON_SCHEMA)
    assert walk(matcher, tokenizer, text) < len(tokenizer.encode(text))
    optional_score = {k: v for k, v in PERSON.items() if k != "score"}
    assert accepts_fully(matcher_for(compiler, json=PERSON_SCHEMA), tokenizer,
                         json.dumps(optional_score))


def test_json_object_and_fixed_whitespace(compiler, tokenizer):
    assert accepts_fully(matcher_for(compiler, json_object=True), tokenizer,
                         '{"any": [1, {"x": null}], "y": "z"}')
    assert walk(matcher_for(compiler, json_object=True), tokenizer, "[1]") == 0
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert accepts_fully(matcher_for(compiler, json=schema), tokenizer, '{"a": 1}')
    assert accepts_fully(matcher_for(compiler, json=schema), tokenizer, '{ "a" :1 }')
    fixed = dict(json=schema, disable_any_whitespace=True)
    assert accepts_fully(matcher_for(compiler, **fixed), tokenizer, '{"a": 1}')
    assert not accepts_fully(matcher_for(compiler, **fixed), tokenizer, '{"a":1}')
    assert not accepts_fully(matcher_for(compiler, **fixed), tokenizer, '{ "a": 1}')
    assert accepts_fully(matcher_for(compiler, json_object=True, disable_any_whitespace=True),
                         tokenizer, '{"b": [1, 2]}')


# ---------------------------------------------------------------- other constraints
def test_regex(compiler, tokenizer):
    assert accepts_fully(matcher_for(compiler, regex=r"\d{3}-[a-z]+"), tokenizer, "123-abc")
    assert not accepts_fully(matcher_for(compiler, regex=r"\d{3}-[a-z]+"), tokenizer, "12a-abc")
    assert not accepts_fully(matcher_for(compiler, regex=r"\d{3}-[a-z]+"), tokenizer, "123-")


def test_choice(compiler, tokenizer, backend):
    choices = ["yes", "no", 'caf\u00e9 "quoted"\n']
    for choice in choices:
        assert accepts_fully(matcher_for(compiler, choice=choices), tokenizer, choice)
    assert not accepts_fully(matcher_for(compiler, choice=choices), tokenizer, "maybe")
    matcher = matcher_for(compiler, choice=choices)
    walk(matcher, tokenizer, "yes")
    bitmask = allocate_bitmask(1, backend.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_token_ids(bitmask, 0, backend.vocab_size).tolist() == [EOS]


def test_ebnf_and_lark_grammars(compiler, tokenizer):
    ebnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9]+'
    assert accepts_fully(matcher_for(compiler, grammar=ebnf), tokenizer, "(1+23)")
    assert not accepts_fully(matcher_for(compiler, grammar=ebnf), tokenizer, "(1+)")
    lark = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]+/'
    assert accepts_fully(matcher_for(compiler, grammar=lark), tokenizer, "(1+23)")
    assert not accepts_fully(matcher_for(compiler, grammar=lark), tokenizer, "(+1)")


def test_structural_tag(compiler, tokenizer, backend):
    tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<tool>", "end": "</tool>",
        "content": {"type": "json_schema", "json_schema": {
            "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}}
    if backend.name == "llguidance":  # xgrammar's format: refused, one line
        with pytest.raises(ValueError, match="^the llguidance backend takes no structural tags"):
            compiler.submit(StructuredOutputsParams(structural_tag=tag)).result(timeout=30)
        return
    assert accepts_fully(matcher_for(compiler, structural_tag=tag), tokenizer,
                         '<tool>{"x": 1}</tool>')
    assert not accepts_fully(matcher_for(compiler, structural_tag=json.dumps(tag)), tokenizer,
                             '<tool>{"y": 1}</tool>')


@pytest.mark.parametrize("constraint, message, llguidance_message", [
    (dict(json={"type": "foo"}), 'invalid JSON schema: Unsupported type "foo"', "invalid JSON schema: Invalid type: foo"),
    (dict(json={"type": "string", "pattern": "(("}), "invalid JSON schema: Regex parsing error",
     "invalid JSON schema: regex parse error: error: unclosed group"),
    (dict(regex="(("), "invalid regex: Regex parsing error at position 3", "invalid regex: .*unclosed group"),
    (dict(regex="[a-"), "invalid regex: ", "invalid regex: .*unclosed character class"),
    (dict(grammar="root ::= foo"), 'invalid EBNF grammar: .*Rule "foo" is not defined',
     "invalid EBNF grammar: Rule 'foo' not found"),
    (dict(grammar='start ::= "a"'), "invalid EBNF grammar: .*root", "invalid EBNF grammar: .*root"),
    (dict(grammar="start: foo"), "invalid Lark grammar: .*foo", "invalid Lark grammar: .*foo"),
    (dict(structural_tag={"type": "nope"}), "invalid structural tag: ",
     "the llguidance backend takes no structural tags"),
])
def test_compile_errors_are_one_line_value_errors(compiler, backend, constraint, message, llguidance_message):
    if backend.name == "llguidance":
        message = llguidance_message
    handle = compiler.submit(StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match=f"^{message}") as info:
        handle.result(timeout=30)
    assert "\n" not in str(info.value) and "/project/" not in str(info.value)
    assert handle.ready() and handle.error == str(info.value)


# ---------------------------------------------------------------- matcher
def test_bitmask_allows_exactly_the_accepted_tokens(compiler, tokenizer, backend):
    rng = random.Random(0)
    matcher = matcher_for(compiler, json=PERSON_SCHEMA)
    ids = tokenizer.encode(json.dumps(PERSON))
    bitmask = allocate_bitmask(1, backend.vocab_size)
    for step in (0, 1, 4, 9, 20):
        matcher.accept_many(ids[matcher.num_accepted:step])
        matcher.fill_bitmask(bitmask, 0)
        allowed = set(allowed_token_ids(bitmask, 0, backend.vocab_size).tolist())
        sample = set(rng.sample(range(backend.vocab_size), 300))
        sample |= set(rng.sample(sorted(allowed), min(100, len(allowed))))
        sample |= {0, IM_START, EOS, TOKENIZER_VOCAB, backend.vocab_size - 1}
        for token_id in sorted(sample):
            accepted = matcher.accept(token_id)
            if accepted:
                matcher.rollback(1)
            assert accepted == (token_id in allowed), (step, token_id)


def test_rollback_restores_state(compiler, tokenizer, backend):
    matcher = matcher_for(compiler, json=PERSON_SCHEMA)
    ids = tokenizer.encode(json.dumps(PERSON))
    bitmask = allocate_bitmask(2, backend.vocab_size)
    matcher.accept_many(ids[:7])
    matcher.fill_bitmask(bitmask, 0)
    assert matcher.accept_many(ids[7:15]) == 8
    matcher.rollback(8)
    assert matcher.num_accepted == 7
    matcher.fill_bitmask(bitmask, 1)
    assert torch.equal(bitmask[0], bitmask[1])
    with pytest.raises(ValueError, match="rollback takes 0 to 7 tokens"):
        matcher.rollback(8)
    matcher.accept_many(ids[7:])
    assert matcher.accept(EOS) and matcher.is_terminated
    matcher.rollback(1)  # the stop token
    assert not matcher.is_terminated and matcher.accepts_eos
    matcher.rollback(matcher.num_accepted)
    assert accepts_fully(matcher, tokenizer, json.dumps(PERSON))


def test_padded_and_out_of_range_ids_are_never_accepted(compiler, backend):
    matcher = matcher_for(compiler, regex=".*")  # anything at all
    for token_id in (TOKENIZER_VOCAB, backend.vocab_size - 1, backend.vocab_size, -1):
        assert not matcher.accept(token_id)
    bitmask = allocate_bitmask(1, backend.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    allowed = allowed_token_ids(bitmask, 0, backend.vocab_size)
    assert allowed.max() < TOKENIZER_VOCAB and IM_START not in allowed.tolist()


def test_batch_helpers_match_single_matchers(compiler, tokenizer, backend):
    texts = [json.dumps(PERSON), "123-abc", "no", "(1+2)"]
    constraints = [dict(json=PERSON_SCHEMA), dict(regex=r"\d{3}-[a-z]+"),
                   dict(choice=["yes", "no"]), dict(grammar='root ::= "(" [0-9]+ "+" [0-9]+ ")"')]
    batch = [matcher_for(compiler, **c) for c in constraints]
    single = [matcher_for(compiler, **c) for c in constraints]
    ids = [tokenizer.encode(t) for t in texts]
    rows = [5, 0, 3, 1]
    batch_mask = allocate_bitmask(6, backend.vocab_size)
    single_mask = allocate_bitmask(6, backend.vocab_size)
    for step in range(max(map(len, ids)) + 1):
        tokens = [i[step] if step < len(i) else EOS for i in ids]
        live = [k for k in range(4) if not batch[k].is_terminated]
        fill_bitmasks(batch, batch_mask, rows)
        for matcher, row in zip(single, rows):
            matcher.fill_bitmask(single_mask, row)
        assert torch.equal(batch_mask, single_mask), step
        expected = [single[k].accept(tokens[k]) for k in live]
        assert accept_tokens([batch[k] for k in live], [tokens[k] for k in live]) == expected
        assert all(expected)
    assert all(m.is_terminated for m in batch)
    assert [m.num_accepted for m in batch] == [len(i) + 1 for i in ids]
    fill_bitmasks(batch, batch_mask, rows)  # terminated rows allow only the stop tokens
    for row in rows:
        assert allowed_token_ids(batch_mask, row, backend.vocab_size).tolist() == [EOS]
    fresh = [matcher_for(compiler, regex="[a-z]+") for _ in range(3)]
    tokens = [backend.vocab_size, -5, tokenizer.encode("abc")[0]]
    assert accept_tokens(fresh, tokens) == [False, False, True]
    assert [m.num_accepted for m in fresh] == [0, 0, 1]
    with pytest.raises(ValueError, match="one token per matcher"):
        accept_tokens(fresh, [1])
    with pytest.raises(ValueError, match="one row per matcher"):
        fill_bitmasks(fresh, batch_mask, [0])
    assert accept_tokens([], []) == []


# ---------------------------------------------------------------- compiler
def test_cache_hits_share_one_compile(backend):
    with GrammarCompiler(backend, cache_size=2) as compiler:
        first = compiler.submit(StructuredOutputsParams(json={"type": "object"}))
        again = compiler.submit(StructuredOutputsParams(json='{"type": "object"}'))
        first.result(timeout=30)
        assert again.result() is first.result()
        stats = compiler.stats
        assert (stats.compiled, stats.cache_hits, stats.failed) == (1, 1, 0)
        assert stats.total_compile_s >= stats.last_compile_s > 0
        compiler.submit(StructuredOutputsParams(regex="a")).result(timeout=30)
        compiler.submit(StructuredOutputsParams(regex="b")).result(timeout=30)
        assert len(compiler) == 2  # the JSON schema, least recently used, was evicted
        compiler.submit(StructuredOutputsParams(json={"type": "object"})).result(timeout=30)
        assert compiler.stats.compiled == 4
        bad = StructuredOutputsParams(regex="((")
        for _ in range(2):
            assert compiler.submit(bad).ready() in (True, False)
        with pytest.raises(ValueError):
            compiler.submit(bad).result(timeout=30)
        assert compiler.stats.failed == 1  # a failure is cached too


class _GatedBackend:
    """A backend whose compile waits for a gate: a slow compile on demand."""

    def __init__(self, backend, fail_first_with: BaseException | None = None):
        self.inner = backend
        self.vocab_size, self.stop_token_ids = backend.vocab_size, backend.stop_token_ids
        self.gate = threading.Event()
        self.threads: list[int] = []
        self.fail_first_with = fail_first_with

    def compile(self, key):
        self.threads.append(threading.get_ident())
        assert self.gate.wait(timeout=30)
        if self.fail_first_with is not None:
            error, self.fail_first_with = self.fail_first_with, None
            raise error
        return self.inner.compile(key)

    def new_matcher(self, compiled):
        return self.inner.new_matcher(compiled)


def test_compile_runs_off_the_callers_thread(backend, tokenizer):
    slow = _GatedBackend(backend)
    with GrammarCompiler(slow) as compiler:
        handle = compiler.submit(StructuredOutputsParams(regex="[0-9]+"))
        other = compiler.submit(StructuredOutputsParams(regex="[a-z]+"))
        work_done = sum(range(10_000))  # the caller goes on while the compile waits
        assert work_done and not handle.ready() and not other.ready() and handle.error is None
        with pytest.raises(TimeoutError):
            handle.result(timeout=0.01)
        slow.gate.set()
        matcher = compiler.new_matcher(handle)
        assert accepts_fully(matcher, tokenizer, "42")
        assert other.result(timeout=30) is not None
        assert slow.threads and threading.get_ident() not in slow.threads


def test_unexpected_compile_failure_is_not_cached(backend):
    flaky = _GatedBackend(backend, fail_first_with=MemoryError("out of memory"))
    flaky.gate.set()
    with GrammarCompiler(flaky) as compiler:
        params = StructuredOutputsParams(regex="x+")
        with pytest.raises(MemoryError):
            compiler.submit(params).result(timeout=30)
        assert compiler.submit(params).result(timeout=30) is not None
        assert (compiler.stats.failed, compiler.stats.compiled) == (1, 1)


def test_compiler_and_backend_reject_bad_arguments(backend, tokenizer):
    with pytest.raises(ValueError, match="max_workers >= 1"):
        GrammarCompiler(backend, max_workers=0)
    with pytest.raises(ValueError, match="unknown grammar backend 'outlines'"):
        create_grammar_backend("outlines", tokenizer.hf, PADDED_VOCAB, [EOS])
    with pytest.raises(ValueError, match="stop token ids"):
        create_grammar_backend("xgrammar", tokenizer.hf, PADDED_VOCAB, [])
    with pytest.raises(ValueError, match="unknown structured output kind"):
        backend.compile(GrammarKey("yaml", "a: 1", False))


def test_a_backend_library_not_installed_is_one_line(monkeypatch, tokenizer):
    from slipstream.sampling.grammar import backend as backends
    monkeypatch.setitem(backends.GRAMMAR_BACKENDS, "missing", "slipstream_no_such_module:Backend")
    with pytest.raises(ValueError, match="^the missing backend needs the slipstream_no_such_module package: "
                                         "pip install slipstream_no_such_module$"):
        create_grammar_backend("missing", tokenizer.hf, PADDED_VOCAB, [EOS])


def test_apply_bitmask_ref_masks_a_grammar_row(compiler, tokenizer, backend):
    matcher = matcher_for(compiler, regex="[0-9]+")
    bitmask = allocate_bitmask(2, backend.vocab_size)
    matcher.fill_bitmask(bitmask, 1)  # row 0 stays unconstrained
    logits = apply_bitmask_ref(torch.zeros(2, backend.vocab_size), bitmask)
    digits = allowed_token_ids(bitmask, 1, backend.vocab_size)
    assert torch.equal(logits[1].isfinite().nonzero().flatten(), digits)
    assert set(tokenizer.encode("0123456789")) <= set(digits.tolist())
    assert logits[0].isfinite().all()
