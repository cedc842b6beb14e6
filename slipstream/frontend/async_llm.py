"""`AsyncLLM`: asyncio streaming on an engine core in its own process (or a thread).

`generate` is an async generator of `RequestOutput`s as tokens arrive.  One task per
AsyncLLM reads the core's messages, runs the output processor (detokenization, stop
strings) and wakes the streams with an output due; a stream that fell behind gets the merged
deltas in one output.  Leaving a stream early, or cancelling its task, aborts the
request in the core at once.  With `max_core_restarts` (opt-in; the server's
--max-core-restarts) a core that died is started again after a back-off: the requests it
held end with an error, `is_dead` holds until the new core is ready, and once the restarts
are spent `failed_for_good` says so (the server then exits non-zero).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time

import zmq
import zmq.asyncio

from slipstream.config import EngineConfig
from slipstream.core.client import CoreClient
from slipstream.core.messages import CallResult, CoreDead, StepOutputs, from_core_decoder
from slipstream.errors import EngineDeadError
from slipstream.frontend.output_processor import OutputProcessor
from slipstream.frontend.outputs import OutputKind
from slipstream.frontend.prompts import RequestRejected, ValidatedRequest, admit_request, validate_request
from slipstream.model.loader import load_config, resolve_model_source
from slipstream.sampling.params import SamplingParams
from slipstream.model.tokenizer import load_tokenizer

log = logging.getLogger("slipstream.engine")
MAX_RESTART_BACKOFF_S = 30.0  # the back-off doubles per restart up to this


class AsyncLLM:
    # text prompts longer than this are tokenized on a worker thread, not on the event loop.
    # SmolLM2's tokenizer on a 2-core CPU: 1,024 characters take ~0.33 ms (2,048: 0.66 ms,
    # 16,384: 6.8 ms) and the hop to a thread 0.1 ms, so shorter ones stay on the loop
    tokenize_off_loop_chars: int = 1024

    def __init__(self, model: str | None = None, core: str = "process", core_env: dict | None = None,
                 max_core_restarts: int = 0, core_restart_backoff_s: float = 1.0,
                 **engine_options) -> None:
        """core_env: environment variables for the core process (e.g. its CUDA_VISIBLE_DEVICES);
        max_core_restarts: how many times a core that died is started again (0: never), the
        first after core_restart_backoff_s seconds, each next one after twice as long."""
        if isinstance(max_core_restarts, bool) or not isinstance(max_core_restarts, int) or max_core_restarts < 0:
            raise ValueError(f"max_core_restarts must be an int >= 0, got {max_core_restarts!r}")
        if not (isinstance(core_restart_backoff_s, (int, float)) and 0 <= core_restart_backoff_s < float("inf")):
            raise ValueError(f"core_restart_backoff_s must be a finite number >= 0, got {core_restart_backoff_s!r}")
        config = EngineConfig.from_kwargs(model=model, **engine_options)
        self._core_args = (config, core, core_env)
        self.max_core_restarts, self.core_restart_backoff_s = max_core_restarts, float(core_restart_backoff_s)
        self.core_restarts = 0  # restarts begun so far
        self._restarting: asyncio.Task | None = None
        source = resolve_model_source(model)  # a missing model fails here, before any process starts
        load_config(source)  # and a bad config.json, before transformers reads it for the tokenizer
        if config.tensor_parallel_size > 1:  # head counts that do not split: before the core starts
            from slipstream.core.engine_core import check_parallel_config
            check_parallel_config(config)
        self._client = CoreClient(config, core, core_env)
        try:  # (the tokenizer loads while the core builds the engine)
            self.tokenizer = None if config.load_format == "dummy" else load_tokenizer(source)
            self.info = self._client.wait_ready()
        except BaseException:
            self._client.close()
            raise
        self.model_name = self.info.model_name
        self.max_model_len = self.info.max_model_len
        self.vocab_size = self.info.vocab_size
        self.processor = OutputProcessor(self.tokenizer)
        self.dead_error: str | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self._ids = itertools.count()
        self._closed = False

    # -- state ------------------------------------------------------------------------
    @property
    def is_dead(self) -> bool:
        """The core died (also seen before any call started the output reader)."""
        if self.dead_error is None and not self._closed and not self._client.alive():
            self.dead_error = self._client.exit_description()
        return self.dead_error is not None

    @property
    def failed_for_good(self) -> bool:
        """The core is dead and will not be started again (no restarts left, or none asked for)."""
        restarting = self._restarting is not None and not self._restarting.done()
        return self.is_dead and not restarting and self.core_restarts >= self.max_core_restarts

    @property
    def num_unfinished(self) -> int:
        return len(self.processor)

    @property
    def core_pid(self) -> int | None:
        """The engine core process's pid (core="process"; e.g. to read its CPU time), else None."""
        proc = self._client.proc
        return proc.pid if proc is not None else None

    # -- requests ---------------------------------------------------------------------
    def validate(self, prompt, sampling_params: SamplingParams | None = None) -> ValidatedRequest:
        """The front door (`frontend.prompts.validate_request`): a ValidatedRequest, or a
        one-line TypeError / ValueError."""
        return validate_request(prompt, sampling_params, self.tokenizer, self.info)

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, output_kind: OutputKind = OutputKind.DELTA,
                       stream_interval: int = 1):
        """Yield a RequestOutput as tokens arrive; the last has `finished` set. `prompt` is a
        text, token ids, or a ValidatedRequest (from `validate`: not checked again, and it
        carries its params). A prompt that cannot run ends alone, as an error output.
        `output_kind` DELTA: each output has what is new, one per `stream_interval` tokens of
        a completion, and a completion's whole text and token ids come when it finishes;
        FINAL_ONLY: only the last output, every completion whole (frontend/outputs.py)."""
        self._check_alive()
        self._start_reader()
        request_id = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        try:
            request = await admit_request(self.validate, prompt, sampling_params, self.tokenize_off_loop_chars)
        except RequestRejected as e:  # fails alone, as an output
            yield e.output(request_id, time.time())
            return
        state = self.processor.new_request(request_id, request.prompt, request.prompt_token_ids, request.params,
                                           output_kind, stream_interval)
        state.waiter = asyncio.Event()
        try:
            self._client.send_many(self.processor.add(state))
        except EngineDeadError as e:
            self.processor.abort(request_id)
            self.dead_error = self.dead_error or str(e)
            raise
        try:
            while True:
                await state.waiter.wait()
                state.waiter.clear()
                if not state.has_output():
                    continue
                out = state.output()
                yield out
                if out.finished:
                    return
        finally:
            if not state.finished:  # the caller left early, or its task was cancelled
                self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> None:
        ids = self.processor.abort(request_id)
        if ids and not self.is_dead and not self._closed:
            self._client.abort(ids)

    async def abort(self, request_id: str) -> None:
        state = self.processor.requests.get(request_id)
        self._abort_now(request_id)
        if state is not None and state.waiter is not None:
            state.waiter.set()

    async def stats(self) -> dict:
        return await self._call("stats")

    async def reset_prefix_cache(self) -> None:
        await self._call("reset_prefix_cache")

    async def _call(self, method: str, *args):
        self._check_alive()
        self._start_reader()
        call = self._client.new_call(method, list(args))
        fut = asyncio.get_running_loop().create_future()
        self._calls[call.call_id] = fut
        self._client.send(call)
        return await fut

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        if self._closed:
            raise EngineDeadError("this AsyncLLM was shut down")

    # -- the reader task ----------------------------------------------------------------
    def _start_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_outputs())

    async def _read_outputs(self) -> None:
        sock = zmq.asyncio.Socket.from_socket(self._client.out_sock)
        try:
            while True:
                if not await sock.poll(500):
                    if not self._client.alive():
                        return self._die(self._client.exit_description())
                    continue
                # Take every message waiting, not one: when the streams fall behind the core,
                # each wake-up then carries the tokens of several steps in one chunk.
                frames = [await sock.recv()]
                while True:
                    try:
                        frames.append(self._client.out_sock.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                for frame in frames:
                    msg = from_core_decoder.decode(frame)
                    if isinstance(msg, StepOutputs):
                        self._client.abort(self._process(msg.outputs))
                    elif isinstance(msg, CallResult):
                        self._resolve(msg)
                    elif isinstance(msg, CoreDead):
                        self._process(msg.outputs)  # the core's error outputs, then the death,
                        return self._die(msg.message)  # with no await between them
        except (zmq.ZMQError, asyncio.CancelledError):
            return

    def _process(self, outputs) -> list[str]:
        """Hand the core's outputs to their streams; returns the ids to abort in the core."""
        touched, aborts = self.processor.process(outputs)
        for state in touched:
            if state.waiter is not None:
                state.waiter.set()
        return aborts

    def _resolve(self, msg: CallResult) -> None:
        fut = self._calls.pop(msg.call_id, None)
        if fut is None or fut.done():
            return
        if msg.error is not None:
            fut.set_exception(RuntimeError(msg.error))
        else:
            fut.set_result(msg.result)

    def _die(self, message: str) -> None:
        self.dead_error = message
        for state in self.processor.fail_all(message):
            if state.waiter is not None:
                state.waiter.set()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(message))
        self._calls.clear()
        if self.core_restarts < self.max_core_restarts and not self._closed and (
                self._restarting is None or self._restarting.done()):
            self._restarting = asyncio.get_running_loop().create_task(self._restart())
        elif self.max_core_restarts:
            log.error("the engine core died (%s); its %d restarts are spent", message, self.max_core_restarts)

    async def _restart(self) -> None:
        """Start a new core after a back-off, until one is ready or the restarts are spent."""
        loop = asyncio.get_running_loop()
        while self.core_restarts < self.max_core_restarts and not self._closed:
            self.core_restarts += 1
            delay = min(self.core_restart_backoff_s * 2 ** (self.core_restarts - 1), MAX_RESTART_BACKOFF_S)
            log.warning("the engine core died (%s); restart %d of %d in %.1f s", self.dead_error,
                        self.core_restarts, self.max_core_restarts, delay)
            await asyncio.sleep(delay)
            await loop.run_in_executor(None, self._client.close)
            try:
                client = CoreClient(*self._core_args)
                info = await loop.run_in_executor(None, client.wait_ready)
            except Exception as e:  # noqa: BLE001 - a start that failed counts as a restart spent
                log.error("restart %d of the engine core failed: %s", self.core_restarts, e)
                continue
            if self._closed:
                await loop.run_in_executor(None, client.close)
                return
            self._client, self.info, self.dead_error = client, info, None
            self._reader = None
            self._start_reader()
            log.warning("the engine core is back (restart %d of %d)", self.core_restarts, self.max_core_restarts)
            return
        log.error("the engine core is dead and its %d restarts are spent", self.max_core_restarts)

    # -- shutdown ---------------------------------------------------------------------
    async def shutdown(self) -> None:
        if self._closed:
            return
        if self.is_dead:  # its open requests end with the core's death, not as aborted
            self._die(self.dead_error)
        self._closed = True
        if self._restarting is not None and not self._restarting.done():
            self._restarting.cancel()
            try:
                await self._restarting
            except asyncio.CancelledError:
                pass
        for rid in list(self.processor.requests):
            state = self.processor.requests[rid]
            self.processor.abort(rid)
            if state.waiter is not None:
                state.waiter.set()
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
        await asyncio.get_running_loop().run_in_executor(None, self._client.close)

    def close(self) -> None:
        """Shut down from outside an event loop."""
        if not self._closed:
            self._closed = True
            self._client.close()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()
