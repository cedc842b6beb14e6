"""A small in-process stand-in for `slipstream.AsyncLLM`, an `EngineClient` (frontend/protocol.py)
with the real front door (`validate_request`), for fast tests of the server's protocol logic
(no model, no core process).

Tokens are bytes (id = byte + 3; 0 pad, 1 BOS, 2 EOS). Completion j of a request writes
`text` from offset j, one token per `token_delay` seconds (0 by default: each token still yields to
the event loop, so requests interleave and disconnects land mid-stream, without sleeping ~2 ms a
token); at most `max_num_seqs` requests
run at once, the rest wait. Logprobs are made up but deterministic. The outputs come from
the real output processor, as AsyncLLM's do.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from types import SimpleNamespace

from slipstream.core.messages import CoreInfo, CoreOutput
from slipstream.frontend.output_processor import OutputProcessor
from slipstream.frontend.outputs import OutputKind
from slipstream.frontend.prompts import RequestRejected, ValidatedRequest, admit_request, validate_request
from slipstream.model.tokenizer import Tokenizer

SPECIAL = {0: "<pad>", 1: "<s>", 2: "</s>"}


class FakeHFTokenizer:
    """What `slipstream.model.tokenizer.Tokenizer` needs of a transformers tokenizer. Its chat
    template writes `<role>content` lines, then `<assistant>` for the generation prompt;
    template variables come first as `<k=v>`."""
    eos_token, eos_token_id, bos_token, bos_token_id = "</s>", 2, "<s>", 1
    pad_token, unk_token, name_or_path = "<pad>", None, "fake"
    chat_template = "{fake}"

    def __len__(self) -> int:
        return FakeTokenizer.vocab_size

    adds_bos = False  # a test may set it: encode then starts with BOS unless told not to

    def encode(self, text, add_special_tokens=True):
        return [1] * (self.adds_bos and add_special_tokens) + [b + 3 for b in text.encode("utf-8")]

    def apply_chat_template(self, conversation, chat_template=None, add_generation_prompt=False,
                            continue_final_message=False, tokenize=True, **kwargs):
        for m in conversation:
            if m["role"] == "assistant" and m is conversation[0]:
                raise ValueError("conversations must start with a user or system message")
        head = "".join(f"<{k}={v}>" for k, v in sorted(kwargs.items()))
        if chat_template != self.chat_template:
            head = f"<template {chat_template}>" + head
        text = head + "".join(f"<{m['role']}>{m['content']}\n" for m in conversation)
        if continue_final_message:
            text = text[:-1]  # inside the last message: no end of turn
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeTokenizer(Tokenizer):
    """The real Tokenizer (its chat options, its checks) over FakeHFTokenizer; tokens are bytes."""
    vocab_size = 259

    def __init__(self):
        super().__init__(FakeHFTokenizer())

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out, buf = [], bytearray()
        for t in ids:
            if t >= 3:
                buf.append(t - 3)
                continue
            out.append(buf.decode("utf-8", "replace"))
            buf = bytearray()
            if not skip_special_tokens:
                out.append(SPECIAL[t])
        out.append(buf.decode("utf-8", "replace"))
        return "".join(out)


class FakeAsyncLLM:
    def __init__(self, max_model_len: int = 256, max_num_seqs: int = 4,
                 token_delay: float = 0.0, text: str = "Hello world! The sky is blue. "):
        self.tokenizer = FakeTokenizer()
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.vocab_size = FakeTokenizer.vocab_size
        self.info = CoreInfo(model_name=self.model_name, max_model_len=max_model_len, vocab_size=self.vocab_size,
                             eos_token_ids=[2], num_kv_blocks=1000, block_size=16, device="cpu",
                             async_scheduling=True, max_num_batched_tokens=256)
        self.dead_error: str | None = None
        self.token_delay = token_delay
        self.text = text
        self.slots = asyncio.Semaphore(max_num_seqs)
        self.running = self.waiting = 0
        self.blocks_in_use = 0
        self.aborted: list[str] = []
        self._abort_asked: set[str] = set()
        self.finished: list[str] = []
        self._ids = itertools.count()

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def num_unfinished(self) -> int:
        return self.running + self.waiting

    def validate(self, prompt, sampling_params=None) -> ValidatedRequest:
        return validate_request(prompt, sampling_params, self.tokenizer, self.info)

    def _lp(self, tid: int, k: int, pos: int) -> dict[int, float]:
        d = {tid: -0.25 - (pos % 3) * 0.5}
        for r in range(k):
            alt = 3 + ord("a") + r
            d.setdefault(alt, -0.1 * (r + 1))
        return d

    async def generate(self, prompt, sampling_params=None, request_id=None, *,
                       output_kind=OutputKind.DELTA, stream_interval=1):
        rid = request_id or f"fake-{next(self._ids)}"
        try:
            request = await admit_request(self.validate, prompt, sampling_params, 1 << 20)
        except RequestRejected as e:
            yield e.output(rid, time.time())
            return
        ids, params, prompt = request.prompt_token_ids, request.params, request.prompt
        # the real output processor turns the made-up tokens into outputs, as in AsyncLLM
        # (text, stop strings, deltas, output kind, stream interval)
        processor = OutputProcessor(self.tokenizer)
        state = processor.new_request(rid, prompt if isinstance(prompt, str) else None, ids, params,
                                      output_kind, stream_interval)
        processor.add(state)
        metrics = state.metrics
        plp = None
        if params.prompt_logprobs is not None:
            plp = [self._lp(t, params.prompt_logprobs, p) for p, t in enumerate(ids[1:])]
        blocks = (len(ids) + params.max_tokens + 15) // 16 * params.n
        self.waiting += 1
        started = False
        try:
            async with self.slots:
                self.waiting -= 1
                started = True
                self.running += 1
                self.blocks_in_use += blocks
                metrics.queue_time_s = time.time() - metrics.arrival_time
                try:
                    step = 0
                    while not state.finished:
                        await asyncio.sleep(self.token_delay)
                        if rid in self._abort_asked:
                            processor.abort(rid)  # as the real one: a last output
                            metrics.finished_time = time.time()
                        else:
                            processor.process([self._core_output(c, params, step, plp if step == 0 else None)
                                               for c in state.completions if c.finish_reason is None])
                        step += 1
                        if state.has_output():
                            yield state.output()
                    if rid not in self._abort_asked:
                        self.finished.append(rid)
                finally:
                    self.running -= 1
                    self.blocks_in_use -= blocks
        finally:
            if not started:
                self.waiting -= 1
            if rid not in self.finished:
                self.aborted.append(rid)

    def _core_output(self, c, params, step: int, prompt_logprobs) -> CoreOutput:
        """What a core would send for completion `c` at this step: its next character."""
        tid = ord(self.text[(step + c.index) % len(self.text)]) + 3
        return CoreOutput(c.core_id, [tid],
                          new_logprobs=[self._lp(tid, params.logprobs, step)] if params.logprobs is not None else None,
                          new_prompt_logprobs=prompt_logprobs if c.index == 0 else None,
                          finish_reason="length" if len(c.token_ids) + 1 >= params.max_tokens else None)

    async def abort(self, request_id: str) -> None:
        self._abort_asked.add(request_id)

    async def stats(self) -> dict:
        return {"num_running": self.running, "num_waiting": self.waiting, "kv_blocks_total": 1000,
                "kv_blocks_in_use": self.blocks_in_use, "kv_cache_usage": self.blocks_in_use / 1000,
                "num_preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                "prefix_cache_hit_rate": 0.0}

    async def reset_prefix_cache(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    def close(self) -> None:
        pass


def run_app(coro_fn, llm=None, **args):
    """Call coro_fn(client, llm) against a fresh server app on a fake engine, in process
    (httpx's ASGI transport); `args` are the server's flags (as `build_app` reads them)."""
    import httpx

    from slipstream.server.app import build_app

    async def main():
        fake = llm or FakeAsyncLLM()
        base = dict(served_model_name=None, api_key=None, max_waiting=None, stream_interval=1,
                    max_body_bytes=4096, max_num_seqs=4)
        app = build_app(fake, SimpleNamespace(**{**base, **args}))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await asyncio.wait_for(coro_fn(c, fake), 30)
    return asyncio.run(main())
