"""POST /v1/completions: prompts as text or token ids, echo, legacy logprobs, streaming.

`prepare_completion` checks a request and turns it into prompt ids and SamplingParams
(every problem an `APIError`), `complete` runs it to one response body, `stream_completion`
yields its SSE events. The server and run-batch both call these.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator

from slipstream.frontend.prompts import ValidatedRequest
from slipstream.sampling.params import SamplingParams
from slipstream.server.errors import APIError, bad_request
from slipstream.server.protocol import (CompletionChoice, CompletionChunk, CompletionLogprobs,
                                        CompletionRequest, CompletionResponse, UsageInfo,
                                        random_id)
from slipstream.server.structured_request import structured_outputs_of
from slipstream.server.serving_common import (MAX_CHOICES, MAX_PROMPTS, PromptRun, ServingState,
                                              check_common, clean_lp, collect, encode,
                                              make_params, output_error, resolve_max_tokens,
                                              sse, sse_events, truncate_prompt,
                                              validate_prompt)


@dataclass
class PreparedCompletion:
    req: CompletionRequest
    requests: list[ValidatedRequest]  # one per prompt, through the engine's front door
    texts: list[str | None]  # the prompt as sent, for echo (None: decode the ids)
    echo_only: bool  # max_tokens 0 with echo: one token is drawn and dropped
    request_id: str

    @property
    def prompts(self) -> list[list[int]]:
        return [r.prompt_token_ids for r in self.requests]

    @property
    def params(self) -> list[SamplingParams]:
        return [r.params for r in self.requests]


def prepare_completion(state: ServingState, req: CompletionRequest) -> PreparedCompletion:
    state.check_model(req.model)
    check_common(req)
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported (it must equal n)", "best_of")
    p = req.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
        items = [p]
    else:
        items = list(p)
    if not items:
        raise bad_request("the prompt is empty", "prompt")
    if len(items) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(items)}", "prompt")
    if len(items) * req.n > MAX_CHOICES:
        raise bad_request(f"at most {MAX_CHOICES} choices (prompts x n) per request, got "
                          f"{len(items)} x {req.n}", "n")
    echo_only = False
    if req.max_tokens == 0:
        if not req.echo:
            raise bad_request("max_tokens must be at least 1 (0 is allowed only with echo)",
                              "max_tokens")
        echo_only = True
    prompt_lp = req.logprobs if req.echo and req.logprobs is not None else None
    structured = structured_outputs_of(req)
    requests, texts = [], []
    for item in items:
        ids = encode(state, item, req.add_special_tokens) if isinstance(item, str) else list(item)
        whole = len(ids)
        ids = truncate_prompt(state, ids, req.truncate_prompt_tokens)
        max_tokens = 1 if echo_only else resolve_max_tokens(state, req.max_tokens, len(ids))
        sp = make_params(state, req, max_tokens=max_tokens, logprobs=req.logprobs,
                         prompt_logprobs=prompt_lp, structured_outputs=structured)
        requests.append(validate_prompt(state, ids, sp))
        texts.append(item if isinstance(item, str) and len(ids) == whole else None)
    return PreparedCompletion(req, requests, texts, echo_only, random_id("cmpl"))


def _prompt_text(state: ServingState, prep: PreparedCompletion, i: int) -> str:
    text = prep.texts[i]
    if text is None:
        tok = state.tokenizer
        text = tok.decode(prep.prompts[i], skip_special_tokens=False) if tok is not None else ""
    return text


def _legacy_logprobs(state: ServingState, ids: list[int], lps: list, offset: int,
                     prompt: bool = False) -> CompletionLogprobs:
    """The legacy layout for `ids`; with prompt=True the entries are prompt logprobs (the
    first prompt token has none)."""
    out = CompletionLogprobs()
    for pos, tid in enumerate(ids):
        tok = state.token_str(tid)
        d = lps[pos] if lps is not None and pos < len(lps) else None
        out.tokens.append(tok)
        out.text_offset.append(offset)
        offset += len(tok)
        if d is None or (prompt and pos == 0):
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        lp = d.get(tid)
        out.token_logprobs.append(clean_lp(lp) if lp is not None else None)
        top: dict[str, float] = {}
        for k, v in d.items():
            top.setdefault(state.token_str(k), clean_lp(v))
        out.top_logprobs.append(top)
    return out


def _merge(a: CompletionLogprobs | None, b: CompletionLogprobs) -> CompletionLogprobs:
    if a is None:
        return b
    return CompletionLogprobs(tokens=a.tokens + b.tokens,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs,
                              text_offset=a.text_offset + b.text_offset)


def _echo_part(state, prep, i, out) -> tuple[str, CompletionLogprobs | None]:
    text = _prompt_text(state, prep, i)
    lp = None
    if prep.req.logprobs is not None:
        lp = _legacy_logprobs(state, prep.prompts[i], out.prompt_logprobs, 0, prompt=True)
    return text, lp


async def complete(state: ServingState, prep: PreparedCompletion) -> dict:
    finals = await collect(state, prep.requests, prep.request_id)
    req, choices, completion_tokens = prep.req, [], 0
    for i, out in enumerate(finals):
        echo_text, echo_lp = _echo_part(state, prep, i, out) if req.echo else ("", None)
        for c in out.outputs:
            text, lp = echo_text, echo_lp
            if prep.echo_only:
                finish, stop_reason = "length", None
            else:
                completion_tokens += len(c.token_ids)
                text = echo_text + c.text
                if req.logprobs is not None:
                    offset = len(echo_lp and "".join(echo_lp.tokens) or "")
                    lp = _merge(echo_lp, _legacy_logprobs(state, c.token_ids, c.logprobs, offset))
                finish, stop_reason = c.finish_reason, c.stop_reason
            ids = None
            if (req.return_token_ids or state.llm.tokenizer is None) and not prep.echo_only:
                ids = list(c.token_ids)
            choices.append(CompletionChoice(index=i * req.n + c.index, text=text, logprobs=lp,
                                            finish_reason=finish, stop_reason=stop_reason, token_ids=ids))
    prompt_tokens = sum(len(p) for p in prep.prompts)
    usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=prompt_tokens + completion_tokens)
    body = CompletionResponse(id=prep.request_id, model=state.model_name, choices=choices,
                              usage=usage).model_dump()
    for ch in body["choices"]:  # OpenAI's shape: the extension only where asked for
        if ch["token_ids"] is None:
            del ch["token_ids"]
    return body


async def _stream_completion_events(state: ServingState, prep: PreparedCompletion,
                                    run: PromptRun) -> AsyncIterator[str]:
    """The events of stream_completion; `sse_events` ends them (errors, [DONE]). The
    engine's outputs say what to send (OutputKind.DELTA: per choice its new text and tokens,
    one output per --stream-interval tokens, always one at its end); this only formats
    them."""
    req, created = prep.req, int(time.time())
    offsets: dict[int, int] = {}  # choice index -> text offset of its next token (logprobs)
    completion_tokens = 0
    with_ids = req.return_token_ids or state.llm.tokenizer is None

    def chunk(idx, text, lp=None, finish=None, stop_reason=None, ids=None) -> str:
        # a plain dict, not the pydantic models: this runs once per streamed chunk
        ch = {"index": idx, "text": text, "logprobs": lp.model_dump() if lp is not None else None,
              "finish_reason": finish, "stop_reason": stop_reason}
        if with_ids:
            ch["token_ids"] = ids or []
        return sse({"id": prep.request_id, "object": "text_completion", "created": created,
                    "model": state.model_name, "choices": [ch], "usage": None})

    async for i, out in run.events():
        err = output_error(state, out)
        if err is not None:
            raise err
        for c in out.outputs:
            idx = i * req.n + c.index
            if idx not in offsets:  # the choice's first output: the echo
                offsets[idx] = 0
                if req.echo:
                    text, lp = _echo_part(state, prep, i, out)
                    offsets[idx] = len("".join(lp.tokens)) if lp else 0
                    yield chunk(idx, text, lp, "length" if prep.echo_only and c.finished else None)
                if prep.echo_only:
                    continue
            if prep.echo_only:
                if c.finished:
                    yield chunk(idx, "", None, "length")
                continue
            completion_tokens += len(c.new_token_ids)
            lp = None
            if req.logprobs is not None:
                lp = _legacy_logprobs(state, c.new_token_ids, c.new_logprobs, offsets[idx])
                offsets[idx] += len("".join(lp.tokens))
            if c.new_text or lp is not None or c.finished or (with_ids and c.new_token_ids):
                yield chunk(idx, c.new_text, lp, c.finish_reason, c.stop_reason,
                            c.new_token_ids if with_ids else None)
    if run.unfinished:
        raise APIError(503, "the request was aborted (the server is shutting down)")
    if req.stream_options is not None and req.stream_options.include_usage:
        prompt_tokens = sum(len(p) for p in prep.prompts)
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=prompt_tokens + completion_tokens)
        yield sse(CompletionChunk(id=prep.request_id, created=created, model=state.model_name,
                                  choices=[], usage=usage).model_dump())


def stream_completion(state: ServingState, prep: PreparedCompletion,
                            run: PromptRun) -> AsyncIterator[str]:
    return sse_events(_stream_completion_events(state, prep, run), run)
