"""Tool calling on /v1/chat/completions: the request's `tools` and `tool_choice` become a
`ToolPlan` (which tools the template shows, whether and how the reply is parsed, the
constraint that forces a call), and the reply's text becomes `message.tool_calls` (whole,
or as OpenAI's streamed tool-call deltas).

tool_choice "none": the template shows the tools, the reply is text. "auto" (the default
when tools are given; needs --enable-auto-tool-choice and --tool-call-parser, as vLLM):
the server's parser reads whatever calls the model wrote. "required" and a named tool: a
structural tag in the parser family's markup forces one call (or several, with
parallel_tool_calls) whose arguments follow the tool's schema.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from slipstream.sampling.structured import StructuredOutputsParams
from slipstream.server.errors import bad_request
from slipstream.server.tool_parsers import ToolParser
from slipstream.server.tool_parsers.base import new_call_id

__all__ = ["ToolPlan", "plan_tools", "template_messages", "reply_with_tools", "ToolDeltaStream"]


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]]  # as given, for the chat template
    choice: str  # "none", "auto", "required" or "named"
    parser: ToolParser | None  # reads the reply; None: the reply is text
    parallel: bool
    constraint: StructuredOutputsParams | None  # "required" and "named"


def _functions(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of {\"type\": \"function\", \"function\": {...}}",
                          "tools")
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type", "function") == "function"
                and isinstance(fn, dict)):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                              "{\"name\", \"parameters\"}}", "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object",
                              "tools")
        functions.append({"name": fn["name"], "parameters": params})
    return functions


def plan_tools(req, parser_name: str | None, auto_enabled: bool) -> ToolPlan | None:
    """The request's ToolPlan (None: no tools); 400s name the field."""
    for legacy in ("functions", "function_call"):
        if getattr(req, legacy, None) is not None:
            raise bad_request(f"{legacy} is the legacy form of tools and is not supported: "
                              "send tools and tool_choice", legacy)
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    functions = _functions(req.tools)
    parallel = req.parallel_tool_calls is not False
    choice = "auto" if choice is None else choice
    named = None
    if isinstance(choice, dict):
        named = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(named, str):
            raise bad_request('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}', "tool_choice")
        if named not in [f["name"] for f in functions]:
            raise bad_request(f"tool_choice names {named!r}, which is not among the tools",
                              "tool_choice")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise bad_request(f'tool_choice must be "none", "auto", "required" or a named function, '
                          f"got {choice!r}", "tool_choice")
    if choice == "none":
        return ToolPlan(req.tools, "none", None, parallel, None)
    parser = _parser(parser_name)
    if choice == "auto":
        if parser is None or not auto_enabled:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                              "--tool-call-parser to be set", "tool_choice")
        return ToolPlan(req.tools, "auto", parser, parallel, None)
    if parser is None:
        raise bad_request(f"tool_choice {choice if named is None else repr(named)} needs the "
                          "server's --tool-call-parser (the markup the call is written in)",
                          "tool_choice")
    forced = [f for f in functions if named is None or f["name"] == named]
    tag = parser.constraint(forced, parallel and named is None)
    return ToolPlan(req.tools, choice, parser, parallel, StructuredOutputsParams(structural_tag=tag))


def _parser(name: str | None) -> ToolParser | None:
    from slipstream.server.tool_parsers import get_tool_parser
    return get_tool_parser(name) if name else None


def template_messages(msgs: list[dict]) -> list[dict]:
    """Messages as chat templates read them: an assistant's tool call arguments as an
    object (the API sends them as JSON text)."""
    out = []
    for i, m in enumerate(msgs):
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise bad_request(f"messages[{i}].tool_calls must be a list", "messages")
            m = dict(m, tool_calls=[_template_call(i, c) for c in calls])
        out.append(m)
    return out


def _template_call(i: int, call: Any) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"messages[{i}].tool_calls: each call needs function.name", "messages")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise bad_request(f"messages[{i}].tool_calls: function.arguments of "
                              f"{fn['name']!r} is not JSON", "messages") from None
    return dict(call, function=dict(fn, arguments=args))


def reply_with_tools(plan: ToolPlan | None, text: str) -> tuple[str | None, list[dict]]:
    """(message content, tool_calls in OpenAI's form) of a whole reply."""
    if plan is None or plan.parser is None:
        return text, []
    got = plan.parser.extract(text)
    calls = got.tool_calls if plan.parallel else got.tool_calls[:1]
    return got.content, [c.to_openai() for c in calls]


class ToolDeltaStream:
    """One streamed choice's deltas: content without markup, and OpenAI's tool-call deltas.
    A call's first delta has its index, id, type, name and arguments ""; then its arguments
    come in fragments as the model writes them (the sure prefixes the parser tells), the
    last fragment when the call is whole; the fragments concatenate to the arguments the
    unstreamed reply has."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.stream = plan.parser.stream(partial=True)
        self.ids: dict[int, str] = {}  # the calls begun: index -> id

    @property
    def calls(self) -> int:
        return len(self.ids)

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """(content delta, tool-call deltas) for a piece of the reply."""
        d = self.stream.feed(text)
        content, fragments = d.content, d.arguments
        if finished:
            end = self.stream.finish()
            content, fragments = content + end.content, fragments + end.arguments
        deltas: list[dict] = []
        for f in fragments:
            if f.index and not self.plan.parallel:
                continue
            if f.index not in self.ids:
                self.ids[f.index] = new_call_id()
                deltas.append({"index": f.index, "id": self.ids[f.index], "type": "function",
                               "function": {"name": f.name, "arguments": ""}})
            deltas.append({"index": f.index, "function": {"arguments": f.fragment}})
        return content, deltas
