"""build_app(llm, args) -> the FastAPI app of one served engine.

A pure-ASGI gate in front of the routes answers before any body is read: 503 while shutting
down, 401 for /v1/* without the API key, 413 for a Content-Length over the limit; it also
counts the requests in flight for the graceful shutdown. Bodies are parsed here (not by
FastAPI) so bad UTF-8, bad JSON and wrong types all get the same 400 error object.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from slipstream.server import DEFAULT_MAX_BODY_BYTES
from slipstream.server.errors import (APIError, bad_request, error_response,
                                      format_validation_errors, install_error_handlers)
from slipstream.server.metrics import CONTENT_TYPE
from slipstream.server.openapi import openapi_schema
from slipstream.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                        DetokenizeRequest, TokenizeRequest)
from slipstream.server.serving_chat import complete_chat, prepare_chat, render_prompt, stream_chat
from slipstream.server.serving_common import PromptRun, ServingState, encode, off_loop
from slipstream.server.serving_completions import (complete, prepare_completion,
                                                   stream_completion)
from slipstream.model.tokenizer import ChatOptions
from slipstream.server.reasoning_parsers import get_reasoning_parser
from slipstream.server.protocol_responses import ResponsesRequest
from slipstream.server.responses_store import ResponseStore
from slipstream.server.responses_stream import stream_response
from slipstream.server.serving_responses import complete_response, prepare_response
from slipstream.server.tool_parsers import get_tool_parser

_UNCOUNTED = ("/health", "/metrics", "/version", "/openapi.json")


def _opt(args: Any, name: str, default):
    value = getattr(args, name, None) if args is not None else None
    return default if value is None else value


class _Gate:
    def __init__(self, app, state: ServingState, api_key: str | None, max_body: int):
        self.app, self.state, self.max_body = app, state, max_body
        self.api_key = api_key.encode() if api_key is not None else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = dict(scope.get("headers") or ())
        refusal = None
        if self.state.shutting_down and path != "/metrics":
            refusal = error_response(503, "the server is shutting down",
                                     headers={"Retry-After": "5"})
        elif self.api_key is not None and path.startswith("/v1/"):
            # the scheme is case-insensitive (RFC 9110); the key is compared in constant time
            scheme, _, key = headers.get(b"authorization", b"").strip().partition(b" ")
            if not (scheme.lower() == b"bearer"
                    and hmac.compare_digest(key.strip(), self.api_key)):
                refusal = error_response(401, "invalid or missing API key "
                                              "(send 'Authorization: Bearer <key>')")
        if refusal is None:
            try:
                length = int(headers.get(b"content-length", b"0") or 0)
            except ValueError:
                refusal = error_response(400, "invalid Content-Length header")
            else:
                if length > self.max_body:
                    refusal = error_response(413, f"the request body has {length} bytes, more "
                                                  f"than the limit of {self.max_body}")
        if refusal is not None:
            return await refusal(scope, receive, send)
        counted = path not in _UNCOUNTED
        if counted:
            self.state.http_active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            if counted:
                self.state.http_active -= 1


class _SSEResponse(StreamingResponse):
    """An event stream whose engine requests are aborted however the response ends."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
            try:
                await self.body_iterator.aclose()
            except Exception:
                pass


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def parse_body(request: Request, model, limit: int):
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(413, f"the request body is larger than the limit of {limit} bytes")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    return parse_json(text, model)


def parse_json(text: str | bytes, model):
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        msg, param = format_validation_errors(e.errors(include_url=False))
        raise bad_request(msg, param) from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None


async def race_disconnect(request: Request, coro):
    """Run `coro`; if the client disconnects first, cancel it (aborting its engine requests)."""
    task = asyncio.ensure_future(coro)

    async def watch():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if not task.done() or task.cancelled():
        return Response(status_code=499)
    return JSONResponse(task.result())


def _tokenize(state: ServingState, req: TokenizeRequest) -> list[int]:
    if req.messages is not None:  # as vLLM: a chat's special tokens are the template's
        return render_prompt(state, req, add_special_tokens=bool(req.add_special_tokens))
    return encode(state, req.prompt, req.add_special_tokens is not False)


def build_app(llm, args=None) -> FastAPI:
    names = _opt(args, "served_model_name", None) or [llm.model_name]
    if isinstance(names, str):
        names = [names]
    state = ServingState(llm=llm, served_names=list(names),
                         max_num_seqs=_opt(args, "max_num_seqs", 256),
                         max_waiting=_opt(args, "max_waiting", None),
                         stream_interval=_opt(args, "stream_interval", 1),
                         chat_defaults=_opt(args, "chat_defaults", ChatOptions()),
                         reasoning_parser=get_reasoning_parser(_opt(args, "reasoning_parser", None)),
                         tool_call_parser=_opt(args, "tool_call_parser", None),
                         enable_auto_tool_choice=bool(_opt(args, "enable_auto_tool_choice", False)))
    if state.tool_call_parser is not None:
        get_tool_parser(state.tool_call_parser)  # ValueError names the families there are
    if state.enable_auto_tool_choice and state.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    limit = _opt(args, "max_body_bytes", DEFAULT_MAX_BODY_BYTES)
    api_key = _opt(args, "api_key", None)
    if api_key is not None and not api_key.strip():  # it would match no client's key
        raise ValueError("the API key is empty: give a key, or None for no authentication")
    app = FastAPI(title="slipstream", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.openapi = lambda: openapi_schema(app)
    app.state.serving = state
    install_error_handlers(app)
    app.add_middleware(_Gate, state=state, api_key=api_key, max_body=limit)
    started = int(time.time())

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse_body(request, CompletionRequest, limit)
        prep = await off_loop(state, prepare_completion, state, req)
        if req.stream:
            run = PromptRun(state, prep.requests, prep.request_id)
            return _SSEResponse(stream_completion(state, prep, run), run.cancel)
        return await race_disconnect(request, complete(state, prep))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await parse_body(request, ChatCompletionRequest, limit)
        prep = await off_loop(state, prepare_chat, state, req)
        if req.stream:
            run = PromptRun(state, [prep.request], prep.request_id)
            return _SSEResponse(stream_chat(state, prep, run), run.cancel)
        return await race_disconnect(request, complete_chat(state, prep))

    responses = ResponseStore(_opt(args, "responses_store_size", 1000))
    app.state.responses = responses

    @app.post("/v1/responses")
    async def create_response(request: Request):
        req = await parse_body(request, ResponsesRequest, limit)
        history = []
        if req.previous_response_id is not None:  # the store is read on the event loop only
            history = responses.get(req.previous_response_id, "previous_response_id").messages
        prep = await off_loop(state, prepare_response, state, req, history)
        if req.stream:
            run = PromptRun(state, [prep.chat.request], prep.chat.request_id)
            return _SSEResponse(stream_response(state, responses, prep, run), run.cancel)
        return await race_disconnect(request, complete_response(state, responses, prep))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return responses.get(response_id).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        responses.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": started, "owned_by": "slipstream",
                "root": llm.model_name, "parent": None, "max_model_len": llm.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(n) for n in state.served_names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        state.check_model(name)
        return model_card(name)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if llm.is_dead:
            return error_response(503, f"the engine is dead: {llm.dead_error}")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        try:
            stats = await asyncio.wait_for(llm.stats(), timeout=5)
        except Exception:
            stats = None
        return Response(state.metrics.render(stats), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        from slipstream.version import __version__
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await parse_body(request, TokenizeRequest, limit)
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages")
        ids = await off_loop(state, _tokenize, state, req)
        return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids,
                "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await parse_body(request, DetokenizeRequest, limit)
        state.check_model(req.model)
        tok = state.need_tokenizer()
        for i, t in enumerate(req.tokens):
            if not 0 <= t < llm.vocab_size:
                raise bad_request(f"tokens[{i}] = {t} is outside the vocabulary "
                                  f"[0, {llm.vocab_size})", "tokens")
        return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tok = state.need_tokenizer()
        hf = tok.hf

        def s(v):
            return v if v is None or isinstance(v, (str, int)) else str(v)

        return {"tokenizer_class": type(hf).__name__, "model_max_length": llm.max_model_len,
                "vocab_size": llm.vocab_size, "eos_token": s(getattr(hf, "eos_token", None)),
                "eos_token_id": s(getattr(hf, "eos_token_id", None)),
                "bos_token": s(getattr(hf, "bos_token", None)),
                "bos_token_id": s(getattr(hf, "bos_token_id", None)),
                "pad_token": s(getattr(hf, "pad_token", None)),
                "unk_token": s(getattr(hf, "unk_token", None)),
                "chat_template": s(state.chat_defaults.template or getattr(hf, "chat_template", None))}

    return app
