"""A fake OpenAI-compatible streaming server for the load generator's tests.

`python tests/fake_openai_server.py --port P [--first-delay S] [--token-delay S]
[--tokens-per-chunk K]` serves, on 127.0.0.1:

* `POST /v1/completions` and `/v1/chat/completions` (stream only): waits
  --first-delay, then sends `max_tokens` (or `max_completion_tokens`, default 16)
  tokens in chunks of --tokens-per-chunk, one chunk per --token-delay × tokens in it,
  then a `finish_reason` chunk with no content, a usage chunk and `[DONE]`.
  A text prompt starting with `FAIL500` gets an HTTP 500; one starting with
  `FAILSTREAM` gets two content chunks and then an `{"error": ...}` event.
* `GET /v1/models`, `GET /health`;
* `GET /stats`: peak concurrent streams, request count, arrival times (monotonic
  seconds) and the bodies received; `POST /stats/reset` clears them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web

MODEL = "fake-model"


def make_app(first_delay: float, token_delay: float, tokens_per_chunk: int) -> web.Application:
    st = {"active": 0, "peak": 0, "arrivals": [], "bodies": []}

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def health(_):
        return web.Response(text="ok")

    async def stats(_):
        return web.json_response({"peak": st["peak"], "requests": len(st["arrivals"]),
                                  "arrivals": st["arrivals"], "bodies": st["bodies"]})

    async def reset(_):
        st.update(active=0, peak=0, arrivals=[], bodies=[])
        return web.json_response({})

    async def generate(request: web.Request, chat: bool):
        body = await request.json()
        st["arrivals"].append(time.monotonic())
        st["bodies"].append(body)
        prompt = body["messages"][-1]["content"] if chat else body.get("prompt")
        if isinstance(prompt, str) and prompt.startswith("FAIL500"):
            return web.json_response({"error": {"message": "injected failure", "type":
                                                "InternalServerError", "code": 500}}, status=500)
        n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        n_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        fail_stream = isinstance(prompt, str) and prompt.startswith("FAILSTREAM")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        st["active"] += 1
        st["peak"] = max(st["peak"], st["active"])
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(d):
            await resp.write(b"data: " + json.dumps(d).encode() + b"\n\n")

        def chunk(text, finish=None):
            if chat:
                choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish}
            return {"id": "x", "object": obj, "model": MODEL, "choices": [choice]}

        try:
            if chat:
                await send({"id": "x", "object": obj, "model": MODEL, "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""},
                     "finish_reason": None}]})
            await asyncio.sleep(first_delay)
            sent = 0
            while sent < n:
                k = min(tokens_per_chunk, n - sent)
                if sent:
                    await asyncio.sleep(token_delay * k)
                await send(chunk(" tok" * k))
                sent += k
                if fail_stream and sent >= 2:
                    await send({"error": {"message": "injected stream error", "type":
                                          "InternalServerError", "code": 500}})
                    await resp.write(b"data: [DONE]\n\n")
                    return resp
            await send(chunk("", "length"))
            if (body.get("stream_options") or {}).get("include_usage"):
                await send({"id": "x", "object": obj, "model": MODEL, "choices": [],
                            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n,
                                      "total_tokens": n_prompt + n}})
            await resp.write(b"data: [DONE]\n\n")
        finally:
            st["active"] -= 1
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    app.router.add_post("/stats/reset", reset)
    app.router.add_post("/v1/completions", lambda r: generate(r, False))
    app.router.add_post("/v1/chat/completions", lambda r: generate(r, True))
    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--first-delay", type=float, default=0.1)
    p.add_argument("--token-delay", type=float, default=0.01)
    p.add_argument("--tokens-per-chunk", type=int, default=1)
    a = p.parse_args()
    web.run_app(make_app(a.first_delay, a.token_delay, a.tokens_per_chunk),
                host="127.0.0.1", port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
