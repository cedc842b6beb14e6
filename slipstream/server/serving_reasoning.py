"""The reasoning parser in chat (`--reasoning-parser`): a reply's thinking goes to
`reasoning_content` and `reasoning` (vLLM sends both names), its answer to `content`; a
stream sends deltas of the same names; a structured output constrains only the answer;
`reasoning_tokens` counts the thinking's tokens for the usage's reasoning_tokens."""
from __future__ import annotations

from typing import Any

from slipstream.sampling.params import SamplingParams
from slipstream.server.errors import bad_request
from slipstream.server.reasoning_parsers import ReasoningParser, ReasoningSplitter
from slipstream.server.reasoning_parsers.grammar import after_reasoning


def message_fields(parser: ReasoningParser | None, text: str) -> dict[str, Any]:
    """A whole reply's message fields: content, and with a parser reasoning_content and
    reasoning (None when the reply did not think)."""
    if parser is None:
        return {"content": text}
    reasoning, content = parser.split(text)
    return {"content": content, "reasoning_content": reasoning, "reasoning": reasoning}


def reasoning_tokens(parser: ReasoningParser | None, tokenizer, token_ids: list[int],
                     text: str, skip_special_tokens: bool = True) -> int:
    """How many of a reply's tokens are its thinking: those up to and with the one that
    completes the closing tag (the tags count as thinking), all of them when the thinking
    never closed; 0 without a parser or when the reply did not think. `text` is the reply
    as decoded (`skip_special_tokens` as it was). The boundary is searched from the shorter
    side, decoding only the tokens of that side (doubling, then bisecting): a long thinking
    with a short answer costs decodes of the answer's few tokens, not of the whole reply."""
    if parser is None or not token_ids:
        return 0
    end = parser.reasoning_length(text)
    if end == 0 or end >= len(text):
        return len(token_ids) if end else 0
    n = len(token_ids)

    def length(a: int, b: int) -> int:
        return len(tokenizer.decode(token_ids[a:b], skip_special_tokens=skip_special_tokens))

    if end <= len(text) - end:  # the fewest leading tokens whose text reaches past the thinking
        return _first(lambda k: length(0, k) >= end, n)
    answer = len(text) - end  # else: the most trailing tokens whose text fits in the answer
    return n - (_first(lambda m: length(n - m, n) > answer, n) - 1)


def _first(pred, n: int) -> int:
    """The least k in 1..n with pred(k), pred growing with k (n where none is below it)."""
    hi = 1
    while hi < n and not pred(hi):
        hi *= 2
    hi = min(hi, n)
    lo = hi // 2 + 1 if hi > 1 else 1
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def reasoning_delta(reasoning: str, content: str) -> dict[str, str]:
    delta = {}
    if reasoning:
        delta["reasoning_content"] = delta["reasoning"] = reasoning
    if content:
        delta["content"] = content
    return delta


class ChatDeltas:
    """The delta fields of each streamed choice; with a parser, one splitter per choice."""

    def __init__(self, parser: ReasoningParser | None):
        self.parser = parser
        self.splitters: dict[int, ReasoningSplitter] = {}

    def delta(self, index: int, new_text: str, finished: bool) -> dict[str, str]:
        """The delta of `new_text` (empty: nothing to send yet, e.g. a tag held back)."""
        if self.parser is None:
            return {"content": new_text} if new_text else {}
        splitter = self.splitters.get(index)
        if splitter is None:
            splitter = self.splitters[index] = self.parser.splitter()
        piece = splitter.feed(new_text)
        if finished:
            piece = piece + splitter.finish()
        return reasoning_delta(piece.reasoning, piece.content)


def constrain_after_reasoning(parser: ReasoningParser | None,
                              params: SamplingParams) -> SamplingParams:
    """`params` whose structured output (if any) starts after the thinking."""
    if parser is None or params.structured_outputs is None:
        return params
    try:
        return params.clone(structured_outputs=after_reasoning(parser, params.structured_outputs))
    except ValueError as e:
        raise bad_request(str(e), "structured_outputs") from None
