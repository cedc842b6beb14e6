"""What completions, chat, the tokenizer endpoints and run-batch share.

`ServingState` holds the engine (an `EngineClient`) and the server's settings;
`validate_prompt` is the request's one pass through the engine's front door; `PromptRun`
submits one engine request per validated prompt and merges their outputs; the helpers turn
a request into `SamplingParams` (built once; value checks raise `APIError` 400 naming the
field) and logprobs into token strings. `off_loop` runs a request's preparation
(tokenizing, the chat template) on the state's own thread, not on the event loop that
streams every other request.
"""
from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from slipstream.frontend.outputs import OutputKind
from slipstream.frontend.prompts import ValidatedRequest
from slipstream.model.tokenizer import check_text
from slipstream.frontend.protocol import EngineClient
from slipstream.sampling.params import SamplingParams
from slipstream.server.errors import APIError, bad_request
from slipstream.server.metrics import ServerMetrics
from slipstream.server.protocol import UNSUPPORTED
from slipstream.model.tokenizer import ChatOptions

MAX_N = 128
MAX_PROMPTS = 1024
MAX_CHOICES = 4096
_END = object()


@dataclass
class ServingState:
    llm: EngineClient
    served_names: list[str]
    max_num_seqs: int = 256
    max_waiting: int | None = None
    stream_interval: int = 1
    chat_defaults: ChatOptions = field(default_factory=ChatOptions)  # --chat-template, ...
    tool_call_parser: str | None = None  # --tool-call-parser: the family whose calls are read
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice
    reasoning_parser: Any = None  # --reasoning-parser's ReasoningParser (None: replies are all content)
    metrics: ServerMetrics = None  # type: ignore[assignment]
    shutting_down: bool = False
    active_requests: int = 0  # engine requests submitted and not yet ended
    http_active: int = 0  # HTTP requests being answered (the shutdown waits for them)
    tasks: set = field(default_factory=set)
    runs: set = field(default_factory=set)  # single-prompt PromptRuns streaming now
    _token_strs: dict = field(default_factory=dict)
    # one thread: the tokenizer is used by one preparing thread at a time (HF's fast
    # tokenizers may refuse concurrent use), and it releases the GIL while it encodes
    prepare_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="slipstream-prepare"))

    def __post_init__(self):
        if self.metrics is None:
            self.metrics = ServerMetrics(self.served_names[0])

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_names:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.served_names)}", "model")

    def close(self) -> None:
        """Stop the preparing thread (once the server stops taking requests)."""
        self.prepare_pool.shutdown(wait=False, cancel_futures=True)

    def need_tokenizer(self):
        tok = self.llm.tokenizer
        if tok is None:
            raise bad_request("this model has no tokenizer (dummy weights): send token-id prompts")
        return tok

    def token_str(self, tid: int) -> str:
        s = self._token_strs.get(tid)
        if s is None:
            tok = self.llm.tokenizer
            s = tok.decode([tid], skip_special_tokens=False) if tok is not None else f"token_id:{tid}"
            self._token_strs[tid] = s
        return s

    def admit(self, count: int) -> None:
        """Refuse (503) when taking `count` more requests would leave more than
        --max-waiting of them waiting for a running slot."""
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": "5"})
        if self.llm.is_dead:
            raise APIError(503, f"the engine is dead: {self.llm.dead_error}")
        if self.max_waiting is None:
            return
        waiting = self.active_requests + count - self.max_num_seqs
        if waiting > self.max_waiting:
            raise APIError(503, f"server overloaded: more than {self.max_waiting} requests would "
                                "wait; retry later", headers={"Retry-After": "1"})


def clean_lp(lp: float) -> float:
    """A logprob JSON can carry (-inf and NaN become -9999.0, as vLLM sends them)."""
    lp = float(lp)
    return lp if math.isfinite(lp) and lp > -9999.0 else -9999.0


def check_common(req) -> None:
    """Field combinations both APIs reject."""
    for name, unused in UNSUPPORTED.items():
        if getattr(req, name) not in (unused, [] if unused is None else unused):
            raise bad_request(f"{name} is not supported by this server", name)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options can only be given when stream is true", "stream_options")
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}], got {req.n}", "n")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")


def make_params(state: ServingState, req, *, max_tokens: int, logprobs: int | None,
                prompt_logprobs: int | None = None, structured_outputs=None) -> SamplingParams:
    vocab = state.llm.vocab_size
    for i, t in enumerate(req.stop_token_ids or ()):
        if not 0 <= t < vocab:
            raise bad_request(f"stop_token_ids[{i}] = {t} is outside the vocabulary [0, {vocab})",
                              "stop_token_ids")
    top_k = req.top_k
    if top_k is not None and top_k > vocab:
        top_k = vocab
    kw = dict(n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens,
              temperature=req.temperature, top_p=req.top_p, top_k=top_k, min_p=req.min_p,
              seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
              ignore_eos=req.ignore_eos, repetition_penalty=req.repetition_penalty,
              presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
              logprobs=logprobs, prompt_logprobs=prompt_logprobs,
              skip_special_tokens=req.skip_special_tokens,
              include_stop_str_in_output=req.include_stop_str_in_output)
    if structured_outputs is not None:
        kw["structured_outputs"] = structured_outputs
    try:
        return SamplingParams.from_dict(kw)
    except ValueError as e:  # its message starts with the field's name
        name = str(e).split(" ", 1)[0]
        raise bad_request(str(e), name if name in kw else None) from None


def resolve_max_tokens(state: ServingState, requested: int | None, prompt_len: int,
                       param: str = "max_tokens") -> int:
    """None: whatever the context leaves; else the value, checked against the context."""
    limit = state.llm.max_model_len
    if requested is None:
        room = limit - prompt_len
        if room < 1:
            raise bad_request(f"this model's maximum context length is {limit} tokens; the prompt "
                              f"has {prompt_len} tokens, which leaves no room to generate", param)
        return room
    if requested < 1:
        raise bad_request(f"{param} must be at least 1, got {requested}", param)
    if prompt_len + requested > limit:
        raise bad_request(f"this model's maximum context length is {limit} tokens; you asked for "
                          f"{prompt_len + requested} tokens ({prompt_len} in the prompt, "
                          f"{requested} to generate)", param)
    return requested


def validate_prompt(state: ServingState, prompt_token_ids: list[int], params: SamplingParams) -> ValidatedRequest:
    """The engine's front door (`EngineClient.validate`), once per prompt: any problem the
    engine would see (empty, outside the vocabulary, too long, more KV blocks than exist)
    becomes a 400."""
    try:
        return state.llm.validate(prompt_token_ids, params)
    except (TypeError, ValueError) as e:
        raise bad_request(str(e), "prompt") from None


async def off_loop(state: ServingState, fn, *args):
    """`fn(*args)` on the state's preparing thread. Tokenizing a long prompt takes long on
    the CPU (1.2 M characters: 0.9 s), and on the event loop it would stall every stream and
    every other request for that time; its `APIError`s reach the caller as raised."""
    return await asyncio.get_running_loop().run_in_executor(state.prepare_pool, fn, *args)


def encode(state: ServingState, text: str, add_special_tokens: bool = True,
           param: str = "prompt") -> list[int]:
    """The token ids of a text prompt; a 400 naming `param` for text no tokenizer takes."""
    tok = state.need_tokenizer()
    try:
        return list(tok.encode(check_text(param, text), add_special_tokens))
    except ValueError as e:
        raise bad_request(str(e), param) from None


def truncate_prompt(state: ServingState, ids: list[int], keep: int | None) -> list[int]:
    """`truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: as many as the context
    holds); None leaves it whole."""
    if keep is None:
        return ids
    if keep == -1:
        keep = state.llm.max_model_len
    if keep < 1:
        raise bad_request(f"truncate_prompt_tokens must be >= 1 or -1, got {keep}",
                          "truncate_prompt_tokens")
    return ids[-keep:]


class PromptRun:
    """One engine request per validated prompt, submitted at once (the server's capacity is
    checked here, before any response starts); `events()` yields (prompt index,
    RequestOutput) as outputs arrive. `cancel()` (also run when `events()` is closed) aborts
    every request still running. `output_kind`: DELTA for a stream (one output per
    --stream-interval tokens of a choice), FINAL_ONLY for one response body."""

    def __init__(self, state: ServingState, prompts: list[ValidatedRequest], request_id: str,
                 output_kind: OutputKind = OutputKind.DELTA):
        state.admit(len(prompts))
        self.state = state
        self.output_kind = output_kind
        self.queue: asyncio.Queue = asyncio.Queue()
        self.remaining = len(prompts)
        self.unfinished = set(range(len(prompts)))  # prompts without a finished output yet
        state.active_requests += len(prompts)
        self.tasks = []
        self.cancelled = False
        # One prompt (the common case) streams straight from the engine in the response's
        # own task: no pump task and queue hop per token. Several prompts get a pump each.
        self.direct = None
        if len(prompts) == 1:
            self.direct = (prompts[0], request_id)
            state.runs.add(self)
            return
        for i, request in enumerate(prompts):
            t = asyncio.ensure_future(self._pump(i, request, f"{request_id}-{i}"))
            state.tasks.add(t)
            t.add_done_callback(state.tasks.discard)
            self.tasks.append(t)

    async def _outputs(self, request: ValidatedRequest, rid: str):
        """The engine's outputs of one prompt, then an APIError if it failed."""
        from slipstream.errors import EngineDeadError

        state = self.state
        tracker = state.metrics.tracker(request.params.n, len(request.prompt_token_ids))
        state.metrics.count_constraint(request.params.structured_outputs)
        gen = state.llm.generate(request, request_id=rid, output_kind=self.output_kind,
                                 stream_interval=state.stream_interval)
        try:
            async for out in gen:
                tracker.update(out)
                yield out
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            yield APIError(503, f"the engine is dead: {e}")
        except ValueError as e:
            yield bad_request(str(e), "prompt")
        except Exception as e:  # an engine failure, not the client's input
            yield APIError(500, f"engine error: {type(e).__name__}: {e}")
        finally:
            await gen.aclose()  # aborts the engine request if it is still running
            tracker.finish()
            state.active_requests -= 1

    async def _pump(self, i: int, request: ValidatedRequest, rid: str) -> None:
        queue = self.queue
        try:
            async for item in self._outputs(request, rid):
                queue.put_nowait((i, item))
        finally:
            queue.put_nowait((i, _END))

    async def _direct_events(self) -> AsyncIterator[tuple[int, Any]]:
        gen = self._outputs(*self.direct)
        try:
            async for item in gen:
                if isinstance(item, APIError):
                    raise item
                if self.cancelled and item.finished and item.finish_reason == "abort":
                    return  # cancelled by a shutdown: the stream reports it unfinished
                if item.finished:
                    self.unfinished.discard(0)
                yield 0, item
        finally:
            await gen.aclose()
            self.state.runs.discard(self)

    async def events(self) -> AsyncIterator[tuple[int, Any]]:
        if self.direct is not None:
            async for ev in self._direct_events():
                yield ev
            return
        try:
            while self.remaining:
                i, item = await self.queue.get()
                if item is _END:
                    self.remaining -= 1
                elif isinstance(item, APIError):
                    raise item
                else:
                    if item.finished:
                        self.unfinished.discard(i)
                    yield i, item
        finally:
            self.cancel()

    def cancel(self) -> None:
        for t in self.tasks:
            t.cancel()
        if self.direct is not None and self.unfinished and not self.cancelled:
            self.cancelled = True
            asyncio.ensure_future(self.state.llm.abort(self.direct[1]))


def output_error(state: ServingState, out) -> APIError | None:
    """The error of a finished output the engine could not run, as an APIError."""
    if out.error or any(c.finish_reason == "error" for c in out.outputs):
        msg = out.error or "the request failed in the engine"
        if state.llm.is_dead:
            return APIError(503, f"the engine is dead: {msg}")
        return bad_request(f"the request could not run: {msg}")
    return None


async def collect(state: ServingState, prompts: list[ValidatedRequest], request_id: str) -> list[Any]:
    """Final RequestOutput of every prompt (non-streaming)."""
    finals: list[Any] = [None] * len(prompts)
    async for i, out in PromptRun(state, prompts, request_id, OutputKind.FINAL_ONLY).events():
        finals[i] = out
    for out in finals:
        if out is None or not out.finished:
            raise APIError(503, "the request was aborted (the server is shutting down)")
        err = output_error(state, out)
        if err is not None:
            raise err
    return finals


async def sse_events(events: AsyncIterator[str], run: "PromptRun") -> AsyncIterator[str]:
    """An event stream that always ends well: an error raised by `events` is sent as an
    error event, the engine requests left are aborted, and `[DONE]` comes last."""
    try:
        async for event in events:
            yield event
    except APIError as e:
        yield sse(e.body())
    except Exception as e:  # never leave a stream without its end
        yield sse(APIError(500, f"internal error: {type(e).__name__}: {e}").body())
    finally:
        run.cancel()
        await events.aclose()  # its engine streams end now, not when collected
    yield "data: [DONE]\n\n"


def sse(data: Any) -> str:
    import json
    if not isinstance(data, str):
        data = json.dumps(data, ensure_ascii=False, allow_nan=False)
    return f"data: {data}\n\n"
