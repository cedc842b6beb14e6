"""The request of the OpenAI Responses API (`POST /v1/responses`, pydantic v2) and the
refusals of what this server does not have.

Unknown fields are ignored, as in protocol.py. Fields this server cannot honour are accepted
only at their "not used" value; any other value gets a 400 naming the field, so an answer
never silently lacks what was asked for.
"""
from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, StrictStr

from slipstream.server.errors import bad_request


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: Union[StrictStr, list[dict[str, Any]]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # not available here: refused unless at their "not used" value (NOT_USED)
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    include: list[str] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    prompt_cache_key: str | None = None


# each refused field with the values that mean "not used"
NOT_USED: dict[str, tuple] = {
    "background": (None, False),
    "conversation": (None,),
    "prompt": (None,),
    "include": (None, []),
    "truncation": (None, "disabled"),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
}

# tool types the OpenAI service runs itself; this server runs none
BUILT_IN_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter",
                  "computer_use_preview", "image_generation", "mcp", "local_shell", "shell",
                  "custom", "apply_patch")


def check_supported(req: ResponsesRequest) -> None:
    """400 naming the first field set to something this server does not do."""
    for name, unused in NOT_USED.items():
        if getattr(req, name) not in unused:
            raise bad_request(f"{name} is not supported by this server", name)
    for key, value in (req.reasoning or {}).items():
        if value is not None:
            raise bad_request(f"reasoning.{key} is not supported by this server (the model "
                              "thinks as its chat template says; --reasoning-parser reports "
                              "the thinking)", f"reasoning.{key}")
    for i, tool in enumerate(req.tools or ()):
        kind = tool.get("type")
        if kind != "function":
            what = "a built-in tool" if kind in BUILT_IN_TOOLS else "a tool type"
            raise bad_request(f"tools[{i}]: {kind!r} is {what} this server does not have; "
                              "only function tools are supported", f"tools[{i}].type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{i}].name must be a non-empty string", f"tools[{i}].name")
