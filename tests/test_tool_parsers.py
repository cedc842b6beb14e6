"""Tool-call parsers (slipstream/server/tool_parsers): fixed model texts of each family, read
whole and streamed split at every position; the server's tool-call deltas (serving_tools),
whose argument fragments arrive as the arguments are written and concatenate to the whole
reply's arguments."""
import json

import pytest

from slipstream.server.tool_parsers import TOOL_PARSERS, get_tool_parser

CALL_F = ("f", {"city": "Paris", "n": 2})
CALL_G = ("g", {"q": "a </tool_call> b", "list": [1, {"x": None}]})

# family -> (text, expected content, expected [(name, args)])
CASES = {
    "hermes": [
        ("Hello there.", "Hello there.", []),
        ('<tool_call>\n{"name": "f", "arguments": {"city": "Paris", "n": 2}}\n</tool_call>', None, [CALL_F]),
        ('Let me look.\n<tool_call>\n{"name": "f", "arguments": {"city": "Paris", "n": 2}}\n</tool_call>\n'
         '<tool_call>\n{"name": "g", "arguments": {"q": "a </tool_call> b", "list": [1, {"x": null}]}}\n'
         '</tool_call>\n', "Let me look.\n", [CALL_F, CALL_G]),
        ('<tool_call>\n{"name": "f", "arguments": {"city": "Paris", "n": 2}}', None, [CALL_F]),  # EOS first
        ('<tool_call>\n{"name": "f", "arguments": {"city": "Paris"}\n</tool_call>',  # malformed
         '<tool_call>\n{"name": "f", "arguments": {"city": "Paris"}\n</tool_call>', []),
        ('<tool_call>{"arguments": {}}</tool_call> no name', '<tool_call>{"arguments": {}}</tool_call> no name', []),
        ("a <tool_ca b", "a <tool_ca b", []),
    ],
    "llama3_json": [
        ("The answer is 4.", "The answer is 4.", []),
        ('{"name": "f", "parameters": {"city": "Paris", "n": 2}}', None, [CALL_F]),
        ('<|python_tag|>{"name": "f", "parameters": {"city": "Paris", "n": 2}}; '
         '{"name": "g", "parameters": {"q": "a </tool_call> b", "list": [1, {"x": null}]}}', None, [CALL_F, CALL_G]),
        ('  {"name": "f", "arguments": {"city": "Paris", "n": 2}}', None, [CALL_F]),
        ('{"name": "f", "parameters": {"city": ', '{"name": "f", "parameters": {"city": ', []),  # cut off
        ('{"a": 1}', '{"a": 1}', []),  # JSON, not a call
        ('I would call {"name": "f"}', 'I would call {"name": "f"}', []),  # not at the beginning
    ],
    "mistral": [
        ("Bonjour.", "Bonjour.", []),
        ('[TOOL_CALLS][{"name": "f", "arguments": {"city": "Paris", "n": 2}}]', None, [CALL_F]),
        ('[TOOL_CALLS] [{"name": "f", "arguments": {"city": "Paris", "n": 2}}, '
         '{"name": "g", "arguments": {"q": "a </tool_call> b", "list": [1, {"x": null}]}}]', None, [CALL_F, CALL_G]),
        ('Sure [TOOL_CALLS][{"name": "f", "arguments": {"city": "Paris", "n": 2}}]', "Sure ", [CALL_F]),
        ('[TOOL_CALLS][{"name": "f", "arguments": {"city"', '[TOOL_CALLS][{"name": "f", "arguments": {"city"', []),
        ('[TOOL_CALLS][{"nome": "f"}]', '[TOOL_CALLS][{"nome": "f"}]', []),
        ("a [TOOL_", "a [TOOL_", []),
        # v11+ tokenizers: [TOOL_CALLS]name[ARGS]{...} a call ([CALL_ID]id before [ARGS] in v13)
        ('[TOOL_CALLS]f[ARGS]{"city": "Paris", "n": 2}', None, [CALL_F]),
        (('Sure [TOOL_CALLS]f[ARGS]{"city": "Paris", "n": 2}[TOOL_CALLS]g[ARGS]'
          '{"q": "a </tool_call> b", "list": [1, {"x": null}]}'), "Sure ", [CALL_F, CALL_G]),
        ('[TOOL_CALLS]f[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris", "n": 2} ok', " ok", [CALL_F]),
        ('[TOOL_CALLS]f[ARGS]{"city"', '[TOOL_CALLS]f[ARGS]{"city"', []),  # cut off
        ("[TOOL_CALLS]f and more", "[TOOL_CALLS]f and more", []),  # a name, no arguments
    ],
}
ALL = [(family, *case) for family, cases in CASES.items() for case in cases]


def calls_of(tool_calls):
    return [(c.name, json.loads(c.arguments)) for c in tool_calls]


def test_registry_has_each_family():
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral"]
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'.*hermes"):
        get_tool_parser("nope")


@pytest.mark.parametrize("family,text,content,calls", ALL)
def test_extract(family, text, content, calls):
    got = get_tool_parser(family).extract(text)
    assert got.content == content
    assert calls_of(got.tool_calls) == calls
    for c in got.tool_calls:
        assert c.id.startswith("call_") and len(c.id) > 10 and c.type == "function"
        assert isinstance(json.loads(c.arguments), dict)


def _streamed(parser, pieces):
    stream, content, calls = parser.stream(), "", []
    for piece in pieces:
        d = stream.feed(piece)
        content, calls = content + d.content, calls + d.tool_calls
    d = stream.finish()
    return content + d.content, calls + d.tool_calls


@pytest.mark.parametrize("family,text,content,calls", ALL)
def test_stream_split_at_every_position(family, text, content, calls):
    parser = get_tool_parser(family)
    for cut in range(len(text) + 1):
        got_content, got_calls = _streamed(parser, [text[:cut], text[cut:]])
        assert (got_content or None) == content, cut
        assert calls_of(got_calls) == calls, cut
    # one character at a time, and no markup ever reaches the content of a call's text
    got_content, got_calls = _streamed(parser, list(text))
    assert (got_content or None) == content and calls_of(got_calls) == calls
    if calls:
        assert all(m not in (got_content or "") for m in parser.start_markers)


def test_stream_gives_content_early_and_holds_a_possible_marker():
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Hello <tool").content == "Hello "
    assert stream.feed("_cal").content == ""
    d = stream.feed('l>{"name": "f", "arguments": {}}</tool_call>')
    assert d.content == "" and [c.name for c in d.tool_calls] == ["f"]
    assert stream.feed(" bye").content == " bye"


FORCED = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}, "required": ["city"]}}, {"name": "add", "parameters": None}]
# family -> (one call, two calls, a call of a tool not offered), as the constraint writes them
FORCED_TEXTS = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>',
               '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
                    '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "add", "parameters": {}}',
                    '{"name": "nope", "parameters": {}}'),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "add", "arguments": {}}]',
                '[TOOL_CALLS][{"name": "nope", "arguments": {}}]'),
}


@pytest.mark.parametrize("family", sorted(FORCED_TEXTS))
def test_the_forcing_constraint_accepts_exactly_calls_the_parser_reads(family):
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    parser = get_tool_parser(family)
    one, two, unknown = FORCED_TEXTS[family]
    parallel = xgr.Grammar.from_structural_tag(json.dumps(parser.constraint(FORCED, True)))
    single = xgr.Grammar.from_structural_tag(json.dumps(parser.constraint(FORCED, False)))
    assert accepts(parallel, one) and accepts(parallel, two) and accepts(single, one)
    assert not accepts(single, two)
    assert not accepts(parallel, unknown) and not accepts(parallel, "") and not accepts(parallel, "Hi")
    assert not accepts(parallel, one.replace('"Paris"', "3"))  # arguments follow the schema
    assert [c.name for c in parser.extract(two).tool_calls] == ["get_weather", "add"]


def _deltas(family, text, step=1, parallel=True):
    """(content, {index: (first delta, argument fragments)}) of `text` streamed `step`
    characters at a time through the server's ToolDeltaStream."""
    from slipstream.server.serving_tools import ToolDeltaStream, ToolPlan

    stream = ToolDeltaStream(ToolPlan([], "auto", get_tool_parser(family), parallel, None))
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    content, calls = "", {}
    for k, piece in enumerate(pieces):
        got, deltas = stream.feed(piece, k == len(pieces) - 1)
        content += got
        for d in deltas:
            if d["index"] not in calls:
                calls[d["index"]] = (d, [])
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]][1].append(d["function"]["arguments"])
    return content, calls


@pytest.mark.parametrize("family,text,content,calls", [c for c in ALL if c[3]])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streamed_argument_fragments_concatenate_to_the_whole_arguments(family, text, content,
                                                                       calls, step):
    whole = get_tool_parser(family).extract(text).tool_calls
    got_content, got = _deltas(family, text, step)
    assert (got_content or None) == content
    assert sorted(got) == list(range(len(whole)))
    for i, call in enumerate(whole):
        first, fragments = got[i]
        assert first["id"].startswith("call_") and first["type"] == "function"
        assert first["function"] == {"name": call.name, "arguments": ""}
        assert "".join(fragments) == call.arguments and all(fragments)


LONG = {"text": "word " * 30, "n": 12345, "ok": True, "nested": {"a": [1, 2.5, None, 'x"y\\ é 😀']}}
_COMPACT, _INDENTED = json.dumps(LONG, separators=(",", ":")), json.dumps(LONG, indent=1)
LONG_TEXTS = {
    "hermes": f'<tool_call>\n{{"name": "f", "arguments": {json.dumps(LONG)}}}\n</tool_call>',
    "llama3_json": f'{{"name": "f", "parameters": {_INDENTED}}}',
    "mistral": f'[TOOL_CALLS][{{"name": "f", "arguments": {_COMPACT}}}]',
    "mistral_v11": "[TOOL_CALLS]f[ARGS]" + json.dumps(LONG, ensure_ascii=False),
}


@pytest.mark.parametrize("case", sorted(LONG_TEXTS))
def test_a_long_argument_streams_in_many_fragments_as_it_is_written(case):
    family, text = case.removesuffix("_v11"), LONG_TEXTS[case]
    (call,) = get_tool_parser(family).extract(text).tool_calls
    assert json.loads(call.arguments) == LONG
    _, got = _deltas(family, text, step=4)
    fragments = got[0][1]
    assert "".join(fragments) == call.arguments
    assert len(fragments) > 30  # not one fragment at the end
    # the words of the long string arrive before the call is whole
    stream_text = text[:text.index("12345")]
    _, early = _deltas(family, stream_text, step=4)
    assert "word " * 29 in "".join(early[0][1])


def test_parallel_false_streams_only_the_first_call():
    text = LONG_TEXTS["mistral_v11"] + '[TOOL_CALLS]g[ARGS]{"z": 1}'
    assert sorted(_deltas("mistral", text, parallel=False)[1]) == [0]
    assert sorted(_deltas("mistral", text)[1]) == [0, 1]


def test_a_committed_call_whose_markup_breaks_is_not_content():
    # the call's start was streamed; its markup then turns out malformed (a brace short):
    # the client has the call, so the markup is not repeated as content
    text = '<tool_call>\n{"name": "f", "arguments": {"city": "Paris"}\n</tool_call> after'
    content, got = _deltas("hermes", text)
    assert content == " after" and got[0][0]["function"]["name"] == "f"


def test_a_long_string_argument_is_not_read_again_at_every_piece():
    # inside a string value the pieces are decoded alone (arguments_stream.GrowingString):
    # the family's partial read, linear in the call's length, runs a few times, not per piece
    code = 'def f(x):\n    return x * 2  # "é" \\ 😀\n' * 300
    args = json.dumps({"path": "a.py", "code": code})
    text = f'<tool_call>\n{{"name": "write", "arguments": {args}}}\n</tool_call>'
    parser = get_tool_parser("hermes")
    reads = []
    real = parser.partial_calls
    parser.partial_calls = lambda pending: reads.append(len(pending)) or real(pending)
    stream, fragments = parser.stream(partial=True), []
    for i in range(0, len(text), 3):
        fragments += [a.fragment for a in stream.feed(text[i:i + 3]).arguments]
    fragments += [a.fragment for a in stream.finish().arguments]
    (call,) = parser.extract(text).tool_calls
    assert "".join(fragments) == call.arguments and json.loads(call.arguments)["code"] == code
    assert len(fragments) > len(text) // 6
    assert len(reads) < 40, len(reads)  # the pieces number len(text) / 3, over 4000


def test_string_piece_holds_back_a_cut_escape_and_stops_at_the_closing_quote():
    from slipstream.server.tool_parsers.partial import string_piece

    assert string_piece(r"ab\n") == ("ab\n", "")
    assert string_piece("ab\\") == ("ab", "\\")
    assert string_piece(r"ab\u00") == ("ab", r"\u00")
    assert string_piece(r"a\ud83d") == ("a", r"\ud83d")  # the pair's low half not yet come
    assert string_piece(r"a\ud83d\ude") == ("a", r"\ud83d\ude")
    assert string_piece(r"a\ud83d\ude00b") == ("a😀b", "")
    assert string_piece(r'a\"b') == ('a"b', "")
    assert string_piece('ab"') is None and string_piece("a\x01") is None
