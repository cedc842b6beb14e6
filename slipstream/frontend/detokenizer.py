"""Incremental detokenization of one request's output, with stop strings.

The tokenizer only has to offer ``decode(ids, skip_special_tokens=...) -> str``.

Two layers:

1. **Token ids -> stable text.** Decoding one token at a time is wrong (byte-level
   BPE tokens may hold part of a UTF-8 character; SentencePiece drops the leading
   space of the first token it decodes), and decoding the whole sequence every
   step costs O(length). We decode a short sliding window instead::

       tokens:  ... | context (<= CONTEXT_TOKENS) | pending (not yet final) |
                    ^ prefix_offset               ^ read_offset

   ``context_text = decode(tokens[prefix:read])`` is cached; each step decodes
   ``tokens[prefix:]`` and the new text is what follows ``context_text``. Text
   that ends in U+FFFD (an incomplete multi-byte character) is held until the
   character completes; once the window ends on clean text the window slides
   forward. The window starts with the last prompt tokens, so the first output
   token merges with the prompt as it would in a full decode. So each step
   decodes at most ``CONTEXT_TOKENS + MAX_PENDING_TOKENS`` tokens (plus one
   decode of the context when the window slides).

   Should a window keep ending in U+FFFD for ``MAX_PENDING_TOKENS`` tokens (the
   model emits invalid byte sequences; a real character spans at most 4 bytes)
   it is released as is: those U+FFFD are genuine. A U+FFFD at the very end is
   released by `finish`.

2. **Stop strings.** The stable text is searched for the stop strings (only the
   part that could hold a new occurrence). On a hit, the released text ends right
   before the earliest occurrence. While generating, the last
   ``max(len(s) for s in stop) - 1`` characters are held back, so a stop string
   is never released in part; `finish` releases them.

For normal tokenizers (byte-level BPE), ``detok.text`` equals
``tokenizer.decode(output_ids)`` cut before the first stop string. Exceptions,
by design: with SentencePiece-style tokenizers the first output token keeps its
leading space when the prompt precedes it (as it would in a decode of prompt +
output); when the prompt itself ends inside a multi-byte character, the output
text starts with the completed character.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

__all__ = ["IncrementalDetokenizer", "CONTEXT_TOKENS", "MAX_PENDING_TOKENS"]

#: Tokens of already-released text kept in front of the decode window, so that a
#: new token merges with the text before it (spaces, SentencePiece prefixes).
CONTEXT_TOKENS = 5

#: After this many tokens whose text still ends in U+FFFD, the U+FFFD is taken
#: as genuine and released (a UTF-8 character spans at most 4 bytes).
MAX_PENDING_TOKENS = 8

_REPLACEMENT_CHAR = "\ufffd"

# Once the window start passes this index, drop the tokens before it.
_TRIM_AT = 1024


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    """Turns the output token ids of one request into text, step by step.

    ``add_token(id)`` returns ``(new_text, stop_hit)``: the text released by this
    token (possibly empty: held back) and whether a stop string was found. After
    a stop hit the request is over: later tokens are ignored (an asynchronous
    engine may still deliver the token of the batch already in flight) and
    `finish` returns "". Without a stop hit, call `finish` when the request ends
    (EOS, max_tokens, abort) to release the text held back.

    ``text`` is all output text released so far (never the prompt).
    ``stop_hit`` is the stop string found, or None.

    ``min_tokens`` (optional, vLLM semantics): stop strings are only looked for
    once ``min_tokens`` output tokens exist; an occurrence that lies entirely in
    the text of the first ``min_tokens - 1`` tokens is ignored.

    ``include_stop`` (vLLM's ``include_stop_str_in_output``): the text released at a
    stop hit ends with the stop string instead of before it.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        *,
        min_tokens: int = 0,
        include_stop: bool = False,
    ) -> None:
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r} in {stop!r}")
        self._tokenizer = tokenizer
        self._skip_special_tokens = bool(skip_special_tokens)
        self.stop: tuple[str, ...] = stop
        self._hold_back = max((len(s) for s in stop), default=1) - 1
        self._min_tokens = int(min_tokens)
        self._include_stop = bool(include_stop)

        # Layer 1: the decode window.
        self._tokens: list[int] = [int(t) for t in list(prompt_token_ids[-CONTEXT_TOKENS:])]
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._context_text = self._decode(self._tokens) if self._tokens else ""
        self._live_emitted = 0  # chars after context_text already moved to _pending

        # Layer 2: stop strings and release.
        # Stable text not released yet: at most the hold-back between steps, so
        # each step costs O(new text), never O(output length).
        self._pending = ""
        self._searched = 0  # no stop string lies entirely within _pending[:_searched]
        self._released: list[str] = []  # released pieces; `text` joins them
        self.stop_hit: str | None = None
        self.finished = False
        self.num_tokens = 0  # output tokens added (the ignored ones not counted)

    # ----------------------------------------------------------------- public
    @property
    def text(self) -> str:
        """All output text released so far (O(length) after new releases: stream
        with the pieces `add_token` returns rather than reading this every step)."""
        released = self._released
        if len(released) > 1:
            released[:] = ["".join(released)]
        return released[0] if released else ""

    @property
    def stopped(self) -> bool:
        return self.stop_hit is not None

    def add_token(self, token_id: int) -> tuple[str, bool]:
        """Add one output token; return (newly released text, stop string hit)."""
        if self.stop_hit is not None:
            return "", True
        if self.finished:
            raise RuntimeError("add_token() called after finish()")
        self._tokens.append(int(token_id))
        self.num_tokens += 1
        self._decode_step(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """The request ended without a stop hit: release everything held back.

        Idempotent; returns "" after a stop hit or a previous call.
        """
        if self.finished or self.stop_hit is not None:
            self.finished = True
            return ""
        self.finished = True
        if len(self._tokens) > self._read_offset:
            self._decode_step(final=True)
        out, _ = self._release(final=True)
        return out

    def final_text(self) -> str:
        """`finish` (if not done yet) and return the whole output text."""
        self.finish()
        return self.text

    # ---------------------------------------------------------------- layer 1
    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_step(self, final: bool) -> None:
        tokens = self._tokens
        full = self._decode(tokens[self._prefix_offset :])
        context = self._context_text
        if full.startswith(context):
            start = len(context)
        else:  # a decoder that rewrites earlier text; keep what still agrees
            start = len(os.path.commonprefix([context, full]))
        live = full[start:]
        pending = len(tokens) - self._read_offset

        clean = True
        stable = live
        if not final and live.endswith(_REPLACEMENT_CHAR) and pending < MAX_PENDING_TOKENS:
            # Possibly an incomplete character: hold it (byte-fallback decoders
            # give one U+FFFD per byte, so strip them all).
            stable = live.rstrip(_REPLACEMENT_CHAR)
            clean = False

        if len(stable) > self._live_emitted:
            self._pending += stable[self._live_emitted :]
            self._live_emitted = len(stable)

        if final:
            return
        if clean and (live or pending >= MAX_PENDING_TOKENS):
            self._slide(full_window_text=full)

    def _slide(self, full_window_text: str) -> None:
        """Everything decoded is final: start a new window after it."""
        old_prefix = self._prefix_offset
        self._read_offset = len(self._tokens)
        self._prefix_offset = max(old_prefix, self._read_offset - CONTEXT_TOKENS)
        self._live_emitted = 0
        if self._prefix_offset == old_prefix:
            self._context_text = full_window_text
        else:
            self._context_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        if self._prefix_offset >= _TRIM_AT:
            del self._tokens[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    # ---------------------------------------------------------------- layer 2
    def _release(self, final: bool) -> tuple[str, bool]:
        pending = self._pending
        if self.stop and self.num_tokens >= self._min_tokens:
            # Everything released lies before any new occurrence: the hold-back
            # (>= len(s) - 1) keeps every unseen occurrence inside `pending`.
            best_index = -1
            best_stop = None
            for s in self.stop:
                i = pending.find(s, max(0, self._searched - len(s) + 1))
                if i != -1 and (best_index == -1 or i < best_index):
                    best_index, best_stop = i, s
            if best_stop is not None:
                out = pending[:best_index + (len(best_stop) if self._include_stop else 0)]
                self._pending = ""
                self._searched = 0
                self.stop_hit = best_stop
                if out:
                    self._released.append(out)
                return out, True

        limit = len(pending) if final else len(pending) - self._hold_back
        if limit <= 0:
            self._searched = len(pending)
            return "", False
        out = pending[:limit]
        self._pending = pending[limit:]
        self._searched = len(self._pending)
        self._released.append(out)
        return out, False
