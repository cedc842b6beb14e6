"""The event stream of `POST /v1/responses` with `stream: true`.

Chat's stream (serving_chat.stream_chat) is read chunk by chunk and retold as the Responses
events, each with its `sequence_number`: response.created, response.in_progress, then per
output item response.output_item.added, its content part (response.content_part.added),
its deltas (response.reasoning_text.delta, response.output_text.delta,
response.function_call_arguments.delta), their done events, response.output_item.done, and
last response.completed (its status "incomplete" when max_output_tokens ended it). A new kind
of delta closes the item before it. An error after the start is an `error` event.
"""
from __future__ import annotations

import json
from typing import AsyncIterator

from slipstream.server.responses_store import ResponseStore
from slipstream.server.serving_chat import stream_chat
from slipstream.server.serving_common import PromptRun, ServingState
from slipstream.server.serving_responses import (PreparedResponse, function_call_item,
                                                 message_item, reasoning_item, remember,
                                                 response_object, status_of, text_part, usage)


class _EventWriter:
    """The open output item and the events that open, grow and close items."""

    def __init__(self):
        self.sequence = 0
        self.output: list[dict] = []  # closed items, as the final response lists them
        self.item: dict | None = None  # the open item
        self.text = ""  # the open item's text (or arguments)
        self.tool_index: int | None = None  # the chat tool call the open item is

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    @property
    def index(self) -> int:
        return len(self.output)

    def _open(self, item: dict) -> list[str]:
        events = self.close()
        self.item, self.text = item, ""
        part = None
        if item["type"] == "message":
            part = text_part("")
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
        if part is not None:
            item["content"] = []  # the part comes in its own event
        events.append(self.event("response.output_item.added", output_index=self.index,
                                 item=item))
        if part is not None:
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=self.index, content_index=0, part=part))
        return events

    def reasoning(self, delta: str) -> list[str]:
        events = [] if self._is_open("reasoning") else self._open(reasoning_item("", "in_progress"))
        self.text += delta
        return events + [self.event("response.reasoning_text.delta", item_id=self.item["id"],
                                    output_index=self.index, content_index=0, delta=delta)]

    def content(self, delta: str) -> list[str]:
        events = [] if self._is_open("message") else self._open(message_item("", "in_progress"))
        if not delta:
            return events
        self.text += delta
        return events + [self.event("response.output_text.delta", item_id=self.item["id"],
                                    output_index=self.index, content_index=0, delta=delta,
                                    logprobs=[])]

    def tool_call(self, call: dict) -> list[str]:
        events = []
        fn = call.get("function") or {}
        if not (self._is_open("function_call") and self.tool_index == call.get("index")):
            events = self._open(function_call_item(call.get("id") or "", fn.get("name") or "",
                                                   "", "in_progress"))
            self.tool_index = call.get("index")
        delta = fn.get("arguments") or ""
        if delta:
            self.text += delta
            events.append(self.event("response.function_call_arguments.delta",
                                     item_id=self.item["id"], output_index=self.index,
                                     delta=delta))
        return events

    def _is_open(self, kind: str) -> bool:
        return self.item is not None and self.item["type"] == kind

    def close(self) -> list[str]:
        item, text = self.item, self.text
        if item is None:
            return []
        where = dict(item_id=item["id"], output_index=self.index)
        events = []
        if item["type"] == "message":
            part = text_part(text)
            events += [self.event("response.output_text.done", **where, content_index=0,
                                  text=text, logprobs=[]),
                       self.event("response.content_part.done", **where, content_index=0,
                                  part=part)]
            item["content"] = [part]
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            events += [self.event("response.reasoning_text.done", **where, content_index=0,
                                  text=text),
                       self.event("response.content_part.done", **where, content_index=0,
                                  part=part)]
            item["content"] = [part]
        else:
            item["arguments"] = text
            events.append(self.event("response.function_call_arguments.done", **where,
                                     name=item["name"], arguments=text))
        item["status"] = "completed"
        events.append(self.event("response.output_item.done", output_index=self.index, item=item))
        self.output.append(item)
        self.item, self.text, self.tool_index = None, "", None
        return events


async def stream_response(state: ServingState, store: ResponseStore, prep: PreparedResponse,
                          run: PromptRun) -> AsyncIterator[str]:
    writer = _EventWriter()
    started = response_object(state, prep, "in_progress", [])
    yield writer.event("response.created", response=started)
    yield writer.event("response.in_progress", response=started)
    finish_reason, counted = None, None
    async for sse in stream_chat(state, prep.chat, run):
        data = sse[len("data: "):].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            err = chunk["error"]
            yield writer.event("error", code=str(err.get("code")), message=err.get("message"),
                               param=err.get("param"))
            return
        if chunk.get("usage"):
            counted = chunk["usage"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            events: list[str] = []
            if delta.get("reasoning_content"):
                events += writer.reasoning(delta["reasoning_content"])
            if delta.get("content"):
                events += writer.content(delta["content"])
            for call in delta.get("tool_calls") or ():
                events += writer.tool_call(call)
            for event in events:
                yield event
            if choice.get("finish_reason") is not None:
                finish_reason = choice["finish_reason"]
    if writer.item is None and not writer.output:
        for event in writer.content(""):  # an empty answer is still a message, as unstreamed
            yield event
    for event in writer.close():
        yield event
    status = status_of(finish_reason)
    u = usage(counted) if counted else None
    final = response_object(state, prep, status, writer.output, usage_=u)
    remember(store, prep, final)
    # response.completed also for an incomplete response (its status says so): the openai
    # client's stream helper waits for that event, and vLLM sends it the same way
    yield writer.event("response.completed", response=final)
