"""Reasoning parsers: fixed outputs split into thinking and answer (Qwen3's two tags,
DeepSeek-R1's open thinking, no think block, an unterminated think), the same split
streamed at every cut position, and the grammar that leaves the thinking free under a
structured output (xgrammar, SmolLM2's tokenizer)."""
from __future__ import annotations

import pytest

from slipstream.sampling.structured import StructuredOutputsParams
from slipstream.server.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser

CASES = [
    # parser, output, (reasoning, content)
    ("qwen3", "<think>\nLet me add.\n</think>\n\nIt is 4.", ("\nLet me add.\n", "\n\nIt is 4.")),
    ("qwen3", "It is 4.", (None, "It is 4.")),  # enable_thinking false: no think block
    ("qwen3", "<think>\nstill thinking when max_tokens", ("\nstill thinking when max_tokens", None)),
    ("qwen3", "<think></think>answer", ("", "answer")),
    ("qwen3", "<thi", (None, "<thi")),  # a cut tag that never completes is text
    ("qwen3", "a </think> b", (None, "a </think> b")),  # no opening tag: all answer
    ("qwen3", "<think>a </thinking> b</think>c</think>", ("a </thinking> b", "c</think>")),
    ("deepseek_r1", "First, 2+2.\n</think>\n\nIt is 4.", ("First, 2+2.\n", "\n\nIt is 4.")),
    ("deepseek_r1", "<think>x</think>y", ("x", "y")),
    ("deepseek_r1", "thinking until the end </thi", ("thinking until the end </thi", None)),
    ("deepseek_r1", "", ("", None)),
]


@pytest.mark.parametrize("name,text,expected", CASES)
def test_split(name, text, expected):
    assert get_reasoning_parser(name).split(text) == expected


@pytest.mark.parametrize("name,text,expected", CASES)
def test_streamed_at_every_cut_equals_the_whole(name, text, expected):
    parser = get_reasoning_parser(name)
    whole = parser.splitter()
    whole_split = whole.feed(text) + whole.finish()
    for cut in range(len(text) + 1):
        for second_cut in (cut, (cut + len(text)) // 2):
            s = parser.splitter()
            pieces = [s.feed(text[:cut]), s.feed(text[cut:second_cut]), s.feed(text[second_cut:]),
                      s.finish()]
            total = sum(pieces[1:], pieces[0])
            assert (total.reasoning, total.content) == (whole_split.reasoning, whole_split.content)
            assert s.result(total) == expected
    # one character at a time, as a stream of single tokens
    s = parser.splitter()
    pieces = [s.feed(ch) for ch in text] + [s.finish()]
    total = sum(pieces, type(pieces[0])())
    assert s.result(total) == expected


def test_a_tag_is_held_back_until_it_is_known():
    s = get_reasoning_parser("qwen3").splitter()
    assert s.feed("<th").reasoning == "" and s.feed("ink>abc</").reasoning == "abc"
    assert s.feed("think>ok").content == "ok"


def test_registry():
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
    assert get_reasoning_parser(None) is None
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'; known: deepseek_r1, qwen3"):
        get_reasoning_parser("nope")


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def backend():
    from slipstream.model.tokenizer import load_tokenizer
    from slipstream.sampling.grammar.backend import create_grammar_backend
    tok = load_tokenizer(None)
    return tok, create_grammar_backend("xgrammar", tok.hf, 49152, [2])


def _accepts(backend, parser, so, text) -> bool:
    """Whether the grammar of `so` after the parser's thinking takes `text` whole and may end."""
    from slipstream.sampling.grammar.matcher import GrammarMatcher
    from slipstream.server.reasoning_parsers.grammar import after_reasoning
    tok, be = backend
    matcher = GrammarMatcher(be, be.compile(after_reasoning(get_reasoning_parser(parser), so).key()))
    ids = tok.encode(text, False)
    return matcher.accept_many(ids) == len(ids) and matcher.accepts_eos


@pytest.mark.slow
@pytest.mark.parametrize("parser,text,ok", [
    ("qwen3", '<think>free {"a": "x"} text, even </th and {</think>\n\n{"a": 3}', True),
    ("qwen3", '{"a": 3}', True),  # no think block (enable_thinking false)
    ("qwen3", '<think>x</think>{"a": "no"}', False),  # the answer is checked
    ("qwen3", '<think>unterminated {"a": 3}', False),
    ("deepseek_r1", 'hmm {bad json</think>\n{"a": 3}', True),
    ("deepseek_r1", '{"a": 3}', False),  # the thinking must close first
    ("qwen3", '<think>x</think>\n\n  {"a": 3}', True),
    ("qwen3", '<think>x</think>\n\n\n\n\n{"a": 3}', False),  # at most four between them
    ("qwen3", '\u205f{"a": 3}', False),  # ASCII whitespace only
])
def test_structured_output_applies_after_the_thinking(backend, parser, text, ok):
    assert _accepts(backend, parser, StructuredOutputsParams(json=SCHEMA), text) is ok


@pytest.mark.slow
@pytest.mark.parametrize("so,answer", [
    (StructuredOutputsParams(regex=r"[0-9]+"), "42"),
    (StructuredOutputsParams(choice=["yes", "no"]), "no"),
    (StructuredOutputsParams(grammar='root ::= "a" "b"+'), "abbb"),
    (StructuredOutputsParams(json_object=True), '{"k": [1]}'),
])
def test_every_constraint_kind_follows_the_thinking(backend, so, answer):
    assert _accepts(backend, "qwen3", so, f"<think>why</think>{answer}")
    assert not _accepts(backend, "qwen3", so, "<think>why</think>~")


def test_a_legacy_structural_tag_is_refused():
    from slipstream.server.reasoning_parsers.grammar import after_reasoning
    legacy = StructuredOutputsParams(structural_tag={"structures": [], "triggers": []})
    with pytest.raises(ValueError, match="legacy"):
        after_reasoning(get_reasoning_parser("qwen3"), legacy)
