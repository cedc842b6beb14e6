"""POST /v1/chat/completions: messages through the model's chat template, chat logprobs,
streaming with the role chunk first. Shared by the server and run-batch."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator

from slipstream.frontend.prompts import ValidatedRequest, normalize_messages
from slipstream.sampling.params import MAX_LOGPROBS, SamplingParams
from slipstream.server.errors import APIError, bad_request
from slipstream.server.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                        ChatCompletionResponse, ChatLogprobs, ChatMessage,
                                        ChatMessageOut, TokenLogprob, TopLogprob, UsageInfo,
                                        ChatTemplateFields, random_id)
from slipstream.server.serving_common import (PromptRun, ServingState, check_common, clean_lp,
                                              collect, make_params, output_error,
                                              resolve_max_tokens, sse, sse_events,
                                              truncate_prompt, validate_prompt)
from slipstream.server.serving_reasoning import (ChatDeltas, constrain_after_reasoning,
                                                 message_fields, reasoning_tokens)
from slipstream.model.tokenizer import ChatOptionError, ChatOptions
from slipstream.server.serving_tools import (ToolDeltaStream, ToolPlan, plan_tools,
                                             reply_with_tools, template_messages)
from slipstream.server.structured_request import structured_outputs_of


@dataclass
class PreparedChat:
    req: ChatCompletionRequest
    request: ValidatedRequest  # the rendered prompt and its params, through the engine's front door
    top_logprobs: int | None  # None: no logprobs
    request_id: str
    echo: str = ""  # what each reply starts with (`echo`: the last message, if the assistant's)
    tools: ToolPlan | None = None  # tools offered: how the reply's calls are read

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """Plain {role, content} dicts for the template (frontend.prompts.normalize_messages);
    an assistant's tool calls with their arguments as objects."""
    try:
        return template_messages(normalize_messages([m.model_dump(exclude_none=True)
                                                     for m in messages]))
    except ValueError as e:
        raise bad_request(str(e), "messages") from None


def chat_options(state: ServingState, req: ChatTemplateFields) -> ChatOptions:
    """The request's template options over the server's (--chat-template,
    --default-chat-template-kwargs)."""
    if req.chat_template is not None:
        raise bad_request("chat_template is not accepted in a request; the server's "
                          "--chat-template sets the template", "chat_template")
    own = ChatOptions(req.add_generation_prompt, req.continue_final_message,
                      dict(req.chat_template_kwargs or {}), tools=req.tools or None)
    return own.over(state.chat_defaults)


def render_prompt(state: ServingState, req: ChatTemplateFields, msgs: list[dict] | None = None,
                  add_special_tokens: bool = False) -> list[int]:
    """The prompt's token ids: `req.messages` (or `msgs`, already normalized) through the
    chat template with the request's options (the template writes the special tokens;
    `add_special_tokens` adds the tokenizer's too)."""
    msgs = chat_messages(req.messages) if msgs is None else msgs
    options = chat_options(state, req)
    tok = state.need_tokenizer()
    if not (tok.has_chat_template or options.template):
        raise bad_request("this model's tokenizer has no chat template; use /v1/completions "
                          "(or start the server with --chat-template)")
    try:
        return list(tok.apply_chat_template(msgs, options, add_special_tokens))
    except ChatOptionError as e:
        raise bad_request(str(e), e.param) from None
    except ValueError as e:  # the template's own rules (role order, ...)
        raise bad_request(str(e), "messages") from None


def prepare_chat(state: ServingState, req: ChatCompletionRequest) -> PreparedChat:
    state.check_model(req.model)
    check_common(req)
    tools = plan_tools(req, state.tool_call_parser, state.enable_auto_tool_choice)
    structured = structured_outputs_of(req)
    if tools is not None and tools.constraint is not None:
        if structured is not None:
            raise bad_request(f"tool_choice {tools.choice!r} forces a tool call; it cannot go with "
                              "an output constraint (response_format, structured_outputs)",
                              "tool_choice")
        structured = tools.constraint
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                          "top_logprobs")
    top = (req.top_logprobs or 0) if req.logprobs else None
    msgs = chat_messages(req.messages)
    ids = truncate_prompt(state, render_prompt(state, req, msgs, req.add_special_tokens),
                          req.truncate_prompt_tokens)
    echo = msgs[-1]["content"] if req.echo and msgs[-1]["role"] == "assistant" else ""
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    wanted = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(state, wanted, len(ids), param)
    params = make_params(state, req, max_tokens=max_tokens, logprobs=top,
                         structured_outputs=structured)
    if tools is not None and tools.parser is not None and tools.parser.keep_special_tokens:
        params = params.clone(skip_special_tokens=False)  # the markup is special tokens
    params = constrain_after_reasoning(state.reasoning_parser, params)
    return PreparedChat(req, validate_prompt(state, ids, params), top, random_id("chatcmpl"), echo,
                        tools)


def _chat_logprobs(state: ServingState, ids: list[int], lps, k: int) -> ChatLogprobs:
    content = []
    for pos, tid in enumerate(ids):
        d = lps[pos] if lps is not None and pos < len(lps) else {}
        tok = state.token_str(tid)
        ranked = sorted(d.items(), key=lambda kv: -clean_lp(kv[1]))[:k]
        top = [TopLogprob(token=state.token_str(t), logprob=clean_lp(v),
                          bytes=list(state.token_str(t).encode("utf-8"))) for t, v in ranked]
        lp = d.get(tid)
        content.append(TokenLogprob(token=tok, logprob=clean_lp(lp if lp is not None else -9999.0),
                                    bytes=list(tok.encode("utf-8")), top_logprobs=top))
    return ChatLogprobs(content=content)


async def complete_chat(state: ServingState, prep: PreparedChat) -> dict:
    (out,) = await collect(state, [prep.request], prep.request_id)
    choices, completion_tokens, thinking = [], 0, 0
    for c in out.outputs:
        completion_tokens += len(c.token_ids)
        thinking += _reasoning_tokens(state, prep, c.token_ids, c.text)
        lp = None
        if prep.top_logprobs is not None:
            lp = _chat_logprobs(state, c.token_ids, c.logprobs, prep.top_logprobs)
        fields = message_fields(state.reasoning_parser, c.text)
        if prep.tools is not None and prep.tools.parser is not None:
            fields["content"], fields["tool_calls"] = reply_with_tools(prep.tools, fields["content"] or "")
        if prep.echo:
            fields["content"] = prep.echo + (fields["content"] or "")
        finish = "tool_calls" if fields.get("tool_calls") else c.finish_reason
        choices.append(ChatChoice(index=c.index, message=ChatMessageOut(**fields),
                                  logprobs=lp, finish_reason=finish,
                                  stop_reason=c.stop_reason))
    usage = UsageInfo(prompt_tokens=len(prep.prompt), completion_tokens=completion_tokens,
                      total_tokens=len(prep.prompt) + completion_tokens)
    return _with_details(state, ChatCompletionResponse(
        id=prep.request_id, model=state.model_name, choices=choices, usage=usage).model_dump(),
        thinking)


def _reasoning_tokens(state: ServingState, prep: PreparedChat, token_ids, text: str) -> int:
    if state.reasoning_parser is None:
        return 0
    return reasoning_tokens(state.reasoning_parser, state.need_tokenizer(), list(token_ids),
                            text, prep.params.skip_special_tokens)


def _with_details(state: ServingState, body: dict, thinking: int) -> dict:
    """`body` whose usage has completion_tokens_details.reasoning_tokens, with a reasoning
    parser (without one the usage stays as the completions endpoint's)."""
    if state.reasoning_parser is not None and body.get("usage") is not None:
        body["usage"]["completion_tokens_details"] = {"reasoning_tokens": thinking}
    return body


async def _stream_chat_events(state: ServingState, prep: PreparedChat, run: PromptRun) -> AsyncIterator[str]:
    """The events of stream_chat; `sse_events` ends them (errors, [DONE]). The engine's
    outputs say what to send (OutputKind.DELTA: per choice its new text and tokens, one
    output per --stream-interval tokens, always one at its end); this only formats them."""
    req, created = prep.req, int(time.time())
    completion_tokens = 0
    deltas = ChatDeltas(state.reasoning_parser)
    parsing = prep.tools is not None and prep.tools.parser is not None
    tool_streams = {idx: ToolDeltaStream(prep.tools) for idx in range(req.n)} if parsing else {}
    counting = (state.reasoning_parser is not None and req.stream_options is not None
                and bool(req.stream_options.include_usage))
    replies = {idx: ([], []) for idx in range(req.n)}  # tokens and text, for reasoning_tokens

    def chunk(idx: int, delta: dict, lp: ChatLogprobs | None = None, finish=None, stop_reason=None) -> str:
        # a plain dict, not the pydantic models: this runs once per streamed chunk
        choice = {"index": idx, "delta": delta, "logprobs": lp.model_dump() if lp is not None else None,
                  "finish_reason": finish, "stop_reason": stop_reason}
        return sse({"id": prep.request_id, "object": "chat.completion.chunk", "created": created,
                    "model": state.model_name, "choices": [choice], "usage": None,
                    "system_fingerprint": None})

    for idx in range(req.n):
        yield chunk(idx, {"role": "assistant", "content": ""})
        if prep.echo:
            yield chunk(idx, {"content": prep.echo})
    async for _, out in run.events():
        err = output_error(state, out)
        if err is not None:
            raise err
        for c in out.outputs:
            completion_tokens += len(c.new_token_ids)
            if counting:
                replies[c.index][0].extend(c.new_token_ids)
                replies[c.index][1].append(c.new_text)
            lp = None
            if prep.top_logprobs is not None:
                lp = _chat_logprobs(state, c.new_token_ids, c.new_logprobs, prep.top_logprobs)
            delta = deltas.delta(c.index, c.new_text, c.finished)
            finish = c.finish_reason
            if parsing:  # the answer without the markup; its calls as tool-call deltas
                calls = tool_streams[c.index]
                text, tool_deltas = calls.feed(delta.pop("content", ""), c.finished)
                if text:
                    delta["content"] = text
                if tool_deltas:
                    delta["tool_calls"] = tool_deltas
                if c.finished and calls.calls:
                    finish = "tool_calls"
            if delta or c.finished or (lp is not None and lp.content):
                yield chunk(c.index, delta or {"content": ""}, lp, finish, c.stop_reason)
    if run.unfinished:
        raise APIError(503, "the request was aborted (the server is shutting down)")
    if req.stream_options is not None and req.stream_options.include_usage:
        n = len(prep.prompt)
        usage = UsageInfo(prompt_tokens=n, completion_tokens=completion_tokens,
                          total_tokens=n + completion_tokens)
        thinking = sum(_reasoning_tokens(state, prep, ids, "".join(texts))
                       for ids, texts in replies.values())
        yield sse(_with_details(state, ChatCompletionChunk(
            id=prep.request_id, created=created, model=state.model_name, choices=[],
            usage=usage).model_dump(), thinking))


def stream_chat(state: ServingState, prep: PreparedChat, run: PromptRun) -> AsyncIterator[str]:
    return sse_events(_stream_chat_events(state, prep, run), run)
