"""Data-parallel serving on a Ray cluster: each replica an `EngineActor` (a Ray actor holding
an `AsyncLLM`), and `RayReplica`, its stand-in in the server process: an `EngineClient`
(frontend/protocol.py), which validates each request there and sends the actor the
validated request.

Outputs cross as msgpack bytes (msgspec encodes the RequestOutput dataclasses), not as
pickled objects.  A replica whose actor died (a call fails, or the 1 s health ping does)
is dead: its open streams end with `EngineDeadError` and `DataParallelLLM` starts a new
actor in its place (the actor itself is never restarted by Ray).
"""
from __future__ import annotations

import asyncio
import itertools
import time

import msgspec

from slipstream.errors import EngineDeadError
from slipstream.frontend.outputs import OutputKind, RequestOutput
from slipstream.frontend.prompts import RequestRejected, ValidatedRequest, admit_request, validate_request
from slipstream.sampling.params import SamplingParams

PING_INTERVAL_S = 1.0
TOKENIZE_OFF_LOOP_CHARS = 1024  # (AsyncLLM's: a longer text is tokenized on a worker thread)
# a killed actor fails its ping at once; the timeout only decides when a live but silent one is
# dead, and a loaded host's slow answer must not count as a death (under a parallel test run on
# 2 cores a replica that was not killed was restarted too with 10 s)
PING_TIMEOUT_S = 30.0
_encoder = msgspec.msgpack.Encoder()
_output_decoder = msgspec.msgpack.Decoder(RequestOutput)


class EngineActor:
    """Runs in the actor process (made a Ray actor class by `_actor_class`)."""

    def __init__(self, model, engine_options: dict) -> None:
        from slipstream.frontend.async_llm import AsyncLLM
        self.llm = AsyncLLM(model, core="process", **engine_options)

    def info(self) -> bytes:
        return _encoder.encode(self.llm.info)

    async def ping(self) -> bool:
        if self.llm.is_dead:
            raise EngineDeadError(self.llm.dead_error)
        return True

    async def generate(self, prompt: str | None, prompt_token_ids: list[int], params: dict, request_id: str,
                       output_kind: str = OutputKind.DELTA.value, stream_interval: int = 1):
        """A request the server process validated (RayReplica.validate, against this actor's
        engine): rebuilt as such, not checked again."""
        request = ValidatedRequest(prompt, prompt_token_ids, SamplingParams.from_validated(params))
        async for out in self.llm.generate(request, request_id=request_id, output_kind=OutputKind(output_kind),
                                           stream_interval=stream_interval):
            yield _encoder.encode(out)

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    async def stats(self) -> dict:
        return await self.llm.stats()

    async def reset_prefix_cache(self) -> None:
        await self.llm.reset_prefix_cache()

    async def shutdown(self) -> None:
        await self.llm.shutdown()


def _actor_class(ray):
    return ray.remote(EngineActor)


class RayReplica:
    def __init__(self, model, engine_options: dict, actor_options: dict) -> None:
        import ray

        from slipstream.core.messages import CoreInfo
        from slipstream.model.loader import resolve_model_source
        from slipstream.model.tokenizer import load_tokenizer

        self._ray = ray
        self.actor = _actor_class(ray).options(**actor_options).remote(model, engine_options)
        try:
            self.info = msgspec.msgpack.decode(ray.get(self.actor.info.remote()), type=CoreInfo)
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"the engine actor did not start: {_cause(e)}") from None
        self.tokenizer = (None if engine_options.get("load_format") == "dummy"
                          else load_tokenizer(resolve_model_source(model)))
        self.model_name, self.max_model_len, self.vocab_size = (self.info.model_name, self.info.max_model_len,
                                                                 self.info.vocab_size)
        self.dead_error: str | None = None
        self._pinger: asyncio.Task | None = None
        self._ids = itertools.count()

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    def validate(self, prompt, sampling_params: SamplingParams | None = None) -> ValidatedRequest:
        """The front door (`frontend.prompts.validate_request`), in the server process."""
        return validate_request(prompt, sampling_params, self.tokenizer, self.info)

    async def generate(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
                       *, output_kind: OutputKind = OutputKind.DELTA, stream_interval: int = 1):
        self._start_pinger()
        if self.dead_error:
            raise EngineDeadError(self.dead_error)
        request_id = str(request_id) if request_id is not None else f"ray-{next(self._ids)}"
        try:
            request = await admit_request(self.validate, prompt, sampling_params, TOKENIZE_OFF_LOOP_CHARS)
        except RequestRejected as e:  # fails alone, as an output
            yield e.output(request_id, time.time())
            return
        stream = self.actor.generate.options(num_returns="streaming").remote(
            request.prompt, request.prompt_token_ids, request.params.to_dict(), request_id,
            OutputKind(output_kind).value, stream_interval)
        finished = False
        try:
            async for ref in stream:
                out = _output_decoder.decode(await ref)
                finished = out.finished
                yield out
        except self._ray.exceptions.RayActorError as e:
            self.dead_error = self.dead_error or f"the engine actor died: {_cause(e)}"
            raise EngineDeadError(self.dead_error) from None
        except self._ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(e.cause, Exception) else None
            if isinstance(cause, (ValueError, TypeError, EngineDeadError)):
                raise cause from None
            raise
        finally:
            if not finished and not self.dead_error:
                self.actor.abort.remote(request_id)

    async def abort(self, request_id: str) -> None:
        if not self.dead_error:
            self.actor.abort.remote(request_id)

    async def stats(self) -> dict:
        self._start_pinger()
        return await self._call(self.actor.stats)

    async def reset_prefix_cache(self) -> None:
        await self._call(self.actor.reset_prefix_cache)

    async def _call(self, method):
        if self.dead_error:
            raise EngineDeadError(self.dead_error)
        try:
            return await method.remote()
        except self._ray.exceptions.RayActorError as e:
            self.dead_error = self.dead_error or f"the engine actor died: {_cause(e)}"
            raise EngineDeadError(self.dead_error) from None

    def _start_pinger(self) -> None:
        if self._pinger is None or self._pinger.done():
            self._pinger = asyncio.get_running_loop().create_task(self._ping())

    async def _ping(self) -> None:
        while self.dead_error is None:
            try:
                await asyncio.wait_for(self.actor.ping.remote(), PING_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - dead actor, dead core, or no answer
                self.dead_error = f"the engine actor died: {_cause(e)}"
                return
            await asyncio.sleep(PING_INTERVAL_S)

    async def shutdown(self) -> None:
        if self._pinger is not None:
            self._pinger.cancel()
        if not self.dead_error:
            try:
                await asyncio.wait_for(self.actor.shutdown.remote(), 30)
            except Exception:  # noqa: BLE001 - it is gone: kill below
                pass
        self.dead_error = self.dead_error or "the replica was shut down"
        self._ray.kill(self.actor)

    def close(self) -> None:
        self.dead_error = self.dead_error or "the replica was shut down"
        self._ray.kill(self.actor)


def _cause(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def ray_replica_factory(model, engine_options: dict, address: str):
    """Replicas as Ray actors on the cluster at `address` ("local": a cluster of this
    machine, started here); one GPU each unless the engine runs on the CPU."""
    from slipstream.ray.cluster import init_ray

    ray = init_ray(None if address == "local" else address)
    on_gpu = engine_options.get("device") != "cpu" and ray.cluster_resources().get("GPU", 0) > 0
    actor_options = dict(num_gpus=1, num_cpus=1) if on_gpu else dict(num_cpus=0.5)
    return lambda index: RayReplica(model, engine_options, dict(actor_options, max_restarts=0))
