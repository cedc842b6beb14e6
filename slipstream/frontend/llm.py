"""`LLM`: offline, blocking inference on an engine core.

By default the core runs inline: this thread steps it (no thread hand-offs, no
serialization: the fastest for one caller; docs/serving.md has the measurement).
`core="thread"` or `"process"` run the same core behind ZMQ, as `AsyncLLM` does.
"""
from __future__ import annotations

from collections.abc import Iterator

from slipstream.config import EngineConfig
from slipstream.core.engine_core import EngineCore
from slipstream.core.messages import CoreDead, CoreOutput, StepOutputs
from slipstream.core.service import dead_message
from slipstream.errors import EngineDeadError
from slipstream.frontend.output_processor import OutputProcessor, RequestState
from slipstream.frontend.outputs import OutputKind, RequestOutput
from slipstream.frontend.prompts import (RequestRejected, ValidatedRequest, chat_token_ids,
                                        sampling_params_of, validate_request)
from slipstream.sampling.params import SamplingParams
from slipstream.model.tokenizer import ChatOptions, load_tokenizer

LLM_CORE_MODES = ("inline", "thread", "process")


class _InlineCore:
    """The core stepped by the caller's thread."""

    def __init__(self, config: EngineConfig, tokenizer) -> None:
        self.engine = EngineCore(config, tokenizer)
        self.info = self.engine.info

    def send(self, msgs) -> None:
        for m in msgs:
            self.engine.add(m)

    def abort(self, ids) -> None:
        self.engine.abort(ids)

    def step(self) -> list[CoreOutput]:
        if not self.engine.has_work():
            return []
        try:
            return self.engine.step()
        except Exception as e:  # noqa: BLE001 - the engine is dead: end every request
            raise _Died(dead_message(e), self.engine.fail_all(dead_message(e))) from e

    def close(self) -> None:
        self.engine.close()


class _RemoteCore:
    """The core in a thread or process, through `CoreClient`."""

    def __init__(self, config: EngineConfig, mode: str) -> None:
        from slipstream.core.client import CoreClient
        self.client = CoreClient(config, mode)
        self.info = self.client.wait_ready()
        self.engine = None  # (the core lives behind the sockets)

    def send(self, msgs) -> None:
        self.client.send_many(msgs)

    def abort(self, ids) -> None:
        self.client.abort(ids)

    def step(self) -> list[CoreOutput]:
        while True:
            try:
                msg = self.client.recv(1000)
            except EngineDeadError as e:
                raise _Died(str(e), []) from None
            if isinstance(msg, StepOutputs):
                return msg.outputs
            if isinstance(msg, CoreDead):
                raise _Died(msg.message, msg.outputs)

    def close(self) -> None:
        self.client.close()


class _Died(Exception):
    def __init__(self, message: str, outputs: list[CoreOutput]) -> None:
        super().__init__(message)
        self.message, self.outputs = message, outputs


class LLM:
    """Offline batch inference: `LLM(model).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | None = None, core: str = "inline", **engine_options) -> None:
        if core not in LLM_CORE_MODES:
            raise ValueError(f"core must be one of {list(LLM_CORE_MODES)}, got {core!r}")
        config = EngineConfig.from_kwargs(model=model, **engine_options)
        from slipstream.core.engine_core import check_parallel_config
        from slipstream.model.loader import load_config, resolve_model_source
        check_parallel_config(config)  # before any process starts
        source = resolve_model_source(model)
        load_config(source)  # its one-line errors, before transformers reads the folder for the tokenizer
        self.tokenizer = None if config.load_format == "dummy" else load_tokenizer(source)
        self._core = _InlineCore(config, self.tokenizer) if core == "inline" else _RemoteCore(config, core)
        self.engine: EngineCore | None = self._core.engine  # inline: the core itself, else None
        self.info = self._core.info
        self.processor = OutputProcessor(self.tokenizer)
        self._finished_early: list[RequestState] = []  # never reached the core (admission)
        self._ids = 0
        self.dead_error: str | None = None
        self._shut_down = False

    # -- requests ---------------------------------------------------------------------
    def validate(self, prompt, sampling_params: SamplingParams | None = None) -> ValidatedRequest:
        """The front door (`frontend.prompts.validate_request`): a ValidatedRequest, or a
        one-line TypeError / ValueError."""
        return validate_request(prompt, sampling_params, self.tokenizer, self.info)

    def _prepare(self, prompt, params: SamplingParams | None, request_id: str | None,
                 output_kind: OutputKind = OutputKind.FINAL_ONLY) -> RequestState:
        """A prompt that is not one raises (TypeError / ValueError); one that can never run
        (RequestRejected) becomes a request that ends with an error output."""
        error = None
        if isinstance(prompt, ValidatedRequest):
            if params is not None:
                raise TypeError("a ValidatedRequest carries its sampling params; pass none beside it")
            text, ids, params = prompt.prompt, prompt.prompt_token_ids, prompt.params
        else:
            params = sampling_params_of(params)
            try:
                request = self.validate(prompt, params)
                text, ids = request.prompt, request.prompt_token_ids
            except RequestRejected as e:
                text, ids, error = e.prompt, e.prompt_token_ids, str(e)
        if request_id is None:
            request_id, self._ids = str(self._ids), self._ids + 1
        elif request_id in self.processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if error:
            return self.processor.rejected(str(request_id), text, ids, params, error, output_kind)
        return self.processor.new_request(str(request_id), text, ids, params, output_kind)

    def _check_open(self) -> None:
        if self._shut_down:
            raise RuntimeError("this LLM was shut down: create a new one to run requests")

    def _submit(self, states: list[RequestState]) -> None:
        self._check_open()
        if self.dead_error:
            raise EngineDeadError(self.dead_error)
        msgs = []
        for s in states:
            if s.finished:
                self._finished_early.append(s)
            else:
                msgs += self.processor.add(s)
        self._core.send(msgs)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    output_kind: OutputKind = OutputKind.FINAL_ONLY) -> str:
        """Queue one request; TypeError / ValueError for a prompt it cannot take. Its outputs
        come from `step()` / `outputs()`: by default one, when it ends; with
        OutputKind.DELTA also what it generates as it goes (frontend/outputs.py)."""
        state = self._prepare(prompt, params, request_id, OutputKind(output_kind))
        self._submit([state])
        return state.request_id

    def abort_request(self, request_id: str) -> None:
        """End a request now; its output (finish_reason "abort") comes with the next step."""
        self._check_open()
        state = self.processor.requests.get(request_id)
        self._core.abort(self.processor.abort(request_id))
        if state is not None:
            self._finished_early.append(state)

    def has_unfinished_requests(self) -> bool:
        return bool(len(self.processor) or self._finished_early)

    def outputs(self) -> Iterator[RequestOutput]:
        """Step until every queued request ended, yielding the outputs as `step` makes them."""
        while self.has_unfinished_requests():
            yield from self.step()

    def step(self) -> list[RequestOutput]:
        """One turn of the engine: the outputs now due, each request's as its output kind
        says (its last one when it ends; with DELTA also its news)."""
        early, self._finished_early = self._finished_early, []
        ready = self._step() if len(self.processor) else []
        # (a request may be listed twice when the engine died: its output goes out once)
        return [s.output() for s in early + ready if s.has_output()]

    def _step(self) -> list[RequestState]:
        self._check_open()
        if self.dead_error:
            raise EngineDeadError(self.dead_error)
        try:
            outs = self._core.step()
        except _Died as died:
            self.dead_error = died.message
            touched, _ = self.processor.process(died.outputs)  # (the core's error outputs)
            return touched + self.processor.fail_all(died.message)
        touched, aborts = self.processor.process(outs)
        if aborts:
            self._core.abort(aborts)
        return touched

    # -- the offline API ----------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        states = [self._prepare(p, sp, None) for p, sp in zip(prompts, params)]
        return self._run(states, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, *, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them.

        chat_template: a Jinja template instead of the tokenizer's; chat_template_kwargs:
        extra template variables (e.g. {"enable_thinking": False}); continue_final_message
        (with add_generation_prompt=False): continue the last message, e.g. an assistant
        reply already begun, instead of starting a new one. tools: OpenAI's function tools,
        shown by the template; read the calls a reply makes with
        `slipstream.server.tool_parsers.get_tool_parser(family).extract(text)`."""
        if messages and isinstance(messages, (list, tuple)) and isinstance(messages[0], dict):
            messages = [messages]
        options = ChatOptions(add_generation_prompt, continue_final_message,
                              dict(chat_template_kwargs or {}), chat_template, tools or None)
        prompts = [chat_token_ids(conv, self.tokenizer, options) for conv in messages]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, states: list[RequestState], use_tqdm: bool) -> list[RequestOutput]:
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(states), desc="generating", unit="req")
        self._submit(states)
        done: dict[str, RequestOutput] = {}
        for out in self.outputs():
            done[out.request_id] = out
            if bar:
                bar.update(1)
        if bar:
            bar.close()
        return [done[s.request_id] for s in states]

    def shutdown(self) -> None:
        """Stop the engine (a second call does nothing); every later call raises RuntimeError."""
        if not self._shut_down:
            self._shut_down = True
            self._core.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; "
                        f"got {type(prompts).__name__}")
    return list(prompts)


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    if not isinstance(params, (list, tuple)):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                        f"{type(params).__name__}"
                        + (": pass SamplingParams(**d) or SamplingParams.from_dict(d)"
                           if isinstance(params, dict) else ""))
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
