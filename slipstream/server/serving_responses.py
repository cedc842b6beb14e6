"""POST /v1/responses: the OpenAI Responses API over the chat completions machinery.

A Responses request becomes a chat request: `instructions` a system message, the stored
conversation of `previous_response_id` then `input` as messages (function_call and
function_call_output items as an assistant's tool calls and tool messages), function tools,
`tool_choice` and `text.format` as chat's tools and response_format. The chat reply becomes
output items: a reasoning item (with --reasoning-parser), a message, function calls. The
stream (responses_stream.py) turns chat's deltas into the Responses event sequence.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from slipstream.server.errors import bad_request, format_validation_errors
from slipstream.server.protocol import ChatCompletionRequest
from slipstream.server.protocol_responses import ResponsesRequest, check_supported
from slipstream.server.responses_store import ResponseStore, StoredResponse
from slipstream.server.serving_chat import PreparedChat, complete_chat, prepare_chat
from slipstream.server.serving_common import ServingState

_INPUT_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class PreparedResponse:
    req: ResponsesRequest
    chat: PreparedChat
    messages: list[dict]  # the conversation sent, without the instructions
    response_id: str
    created_at: int


# ------------------------------------------------------------------ request -> chat
def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}]: only text parts ({', '.join(_TEXT_PARTS)}) are "
                              f"supported, got {kind!r}", f"{where}[{j}].type")
        texts.append(part["text"])
    return "\n".join(texts)


def input_messages(items: str | list[dict]) -> list[dict]:
    """`input` as chat messages. An assistant message and the function_call items after it
    are one assistant turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise bad_request("input must not be empty", "input")
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _INPUT_ROLES:
                raise bad_request(f"{where}.role must be one of {', '.join(_INPUT_ROLES)}, "
                                  f"got {role!r}", f"{where}.role")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad_request(f"{where}.{key} must be a string", f"{where}.{key}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the same turn's calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}.call_id must be a string", f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_of(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue  # earlier thinking: chat templates leave it out of the prompt
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported",
                              f"{where}.type")
    return messages


def chat_tools(req: ResponsesRequest) -> dict[str, Any]:
    """tools, tool_choice and parallel_tool_calls in chat's shape."""
    out: dict[str, Any] = {}
    if req.tools:
        out["tools"] = [{"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}}
            for t in req.tools]
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'name': ...}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    if req.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = req.parallel_tool_calls
    return out


def response_format(text: dict | None) -> dict | None:
    """`text.format` as chat's response_format (None: plain text)."""
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    kind = fmt.get("type")
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    if kind == "json_object":
        return {"type": "json_object"}
    raise bad_request(f"text.format type {kind!r} is not supported (text, json_schema, "
                      "json_object)", "text.format.type")


def prepare_response(state: ServingState, req: ResponsesRequest,
                     history: list[dict]) -> PreparedResponse:
    """Check a request and prepare its chat request; `history` is the stored conversation
    of previous_response_id (looked up by the caller, on the event loop)."""
    state.check_model(req.model)
    check_supported(req)
    messages = history + input_messages(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {"messages": system + messages, "model": req.model,
                            "max_completion_tokens": req.max_output_tokens,
                            "temperature": req.temperature, "top_p": req.top_p,
                            "stream": bool(req.stream), **chat_tools(req)}
    rf = response_format(req.text)
    if rf is not None:
        body["response_format"] = rf
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    try:
        chat_req = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        msg, param = format_validation_errors(e.errors(include_url=False))
        raise bad_request(msg, param) from None
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens must be at least 1, got {req.max_output_tokens}",
                          "max_output_tokens")
    chat = prepare_chat(state, chat_req)
    return PreparedResponse(req, chat, messages, item_id("resp"), int(time.time()))


# ------------------------------------------------------------------ chat -> response
def reasoning_item(text: str, status: str = "completed") -> dict:
    return {"id": item_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str, status: str = "completed") -> dict:
    return {"id": item_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)]}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"id": item_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(message: dict) -> list[dict]:
    """A chat reply's message as output items: reasoning, message, function calls."""
    items = []
    if message.get("reasoning_content") is not None:
        items.append(reasoning_item(message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    content = message.get("content")
    if content or (content is not None and not calls):
        items.append(message_item(content))
    for call in calls:
        fn = call["function"]
        items.append(function_call_item(call["id"], fn["name"], fn["arguments"]))
    return items


def usage(chat_usage: dict) -> dict:
    """A chat usage as the Responses API's (reasoning_tokens: the thinking's tokens, with a
    reasoning parser)."""
    prompt_tokens, output_tokens = chat_usage["prompt_tokens"], chat_usage["completion_tokens"]
    thinking = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": thinking},
            "total_tokens": prompt_tokens + output_tokens}


def response_object(state: ServingState, prep: PreparedResponse, status: str,
                    output: list[dict], finish_reason: str | None = None,
                    usage_: dict | None = None) -> dict:
    req = prep.req
    incomplete = status == "incomplete"
    return {
        "id": prep.response_id, "object": "response", "created_at": prep.created_at,
        "status": status, "model": state.model_name, "output": output,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p,
        "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "text": req.text or {"format": {"type": "text"}},
        "reasoning": req.reasoning, "store": req.store is not False,
        "metadata": req.metadata or {}, "user": req.user, "usage": usage_,
    }


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def conversation_after(prep: PreparedResponse, output: list[dict]) -> list[dict]:
    """The conversation through this response, as chat messages (what a later
    previous_response_id continues)."""
    messages = list(prep.messages)
    turn = input_messages([item for item in output if item["type"] != "reasoning"]) if output else []
    return messages + turn


def remember(store: ResponseStore, prep: PreparedResponse, response: dict) -> None:
    if prep.req.store is not False:
        store.put(StoredResponse(response, conversation_after(prep, response["output"])))


async def complete_response(state: ServingState, store: ResponseStore,
                            prep: PreparedResponse) -> dict:
    chat = await complete_chat(state, prep.chat)
    choice = chat["choices"][0]
    output = output_items(choice["message"])
    response = response_object(state, prep, status_of(choice["finish_reason"]), output,
                               usage_=usage(chat["usage"]))
    remember(store, prep, response)
    return response
