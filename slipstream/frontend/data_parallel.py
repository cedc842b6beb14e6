"""`DataParallelLLM`: N engine replicas behind AsyncLLM's interface (`serve --data-parallel-size`).

Each replica is an `AsyncLLM` with its own engine core process (or, on a Ray cluster, a
Ray actor holding one: `slipstream.ray.serving`).  The `Router` sends each request to the
least loaded replica, or to the one that holds its prompt prefix.  A replica that dies
ends its requests with an `EngineDeadError` naming it; a watcher restarts it while the
others keep serving.  Replicas start one after another, so that replicas sharing a GPU
size their KV caches against memory the earlier ones already hold.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from typing import Callable

import msgspec

from slipstream.core.messages import CoreInfo
from slipstream.errors import EngineDeadError
from slipstream.frontend.prompts import RequestRejected, ValidatedRequest, admit_request, validate_request
from slipstream.frontend.outputs import OutputKind
from slipstream.frontend.protocol import EngineClient
from slipstream.frontend.router import Router
from slipstream.sampling.params import SamplingParams
from slipstream.sched.speculative import SpecStats

log = logging.getLogger("slipstream.data_parallel")
SUMMED = ("num_running", "num_waiting", "kv_blocks_in_use", "kv_blocks_total", "num_preemptions",
          "prefix_cache_queries", "prefix_cache_hits")
WATCH_INTERVAL_S = 0.5
_COUNTER_PREFIXES = ("grammar_", "constrained_", "spec_")
_SPEC_RATIOS = ("spec_mean_accepted_length", "spec_acceptance_rate")
_SPEC_COUNTERS = tuple(k for k in SpecStats().as_dict() if k not in _SPEC_RATIOS)  # (its fields' order)


def local_replica_factory(model: str | None, engine_options: dict, size: int = 1) -> Callable[[int], EngineClient]:
    if _on_cpu(engine_options) and "OMP_NUM_THREADS" not in os.environ:
        # the replicas share this machine's cores: N processes of all-core thread pools
        # would spin against each other (measured: several times slower on 2 cores)
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // size))

    gpus = [] if _on_cpu(engine_options) else visible_gpus()
    tp = engine_options.get("tensor_parallel_size", 1)

    def make(index: int):
        from slipstream.frontend.async_llm import AsyncLLM
        devices = replica_gpus(index, size, tp, gpus)
        env = None if devices is None else {"CUDA_VISIBLE_DEVICES": ",".join(devices)}
        return AsyncLLM(model, core="process", core_env=env, **engine_options)
    return make


def visible_gpus() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d for d in env.split(",") if d.strip()]
    import torch
    return [str(i) for i in range(torch.cuda.device_count())]


def replica_gpus(index: int, size: int, tp: int, gpus: list[str]) -> list[str] | None:
    """The GPUs of replica `index`: its own `tp` of them while there are enough, else the
    replicas share the groups of `tp` GPUs in turn (None: no GPUs)."""
    if not gpus:
        return None
    groups = max(len(gpus) // tp, 1)
    group = index % groups
    return gpus[group * tp:(group + 1) * tp] or gpus[:tp]


class DataParallelLLM:
    tokenize_off_loop_chars: int = 1024  # (AsyncLLM's: a longer text is tokenized on a worker thread)

    def __init__(self, make_replica: Callable[[int], EngineClient], size: int) -> None:
        if size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {size}")
        self._make = make_replica
        self.replicas: list[EngineClient] = []
        try:
            for i in range(size):
                self.replicas.append(make_replica(i))
        except BaseException:
            for r in self.replicas:
                r.close()
            raise
        first = self.replicas[0]
        self.tokenizer = first.tokenizer
        self.model_name, self.max_model_len, self.vocab_size = (first.model_name, first.max_model_len,
                                                                 first.vocab_size)
        self.router = Router(size, first.info.block_size)
        self.restarts = [0] * size
        self._down: set[int] = set()  # dead, being restarted
        self._where: dict[str, int] = {}  # request id -> replica
        self._ids = itertools.count()
        self._watcher: asyncio.Task | None = None
        self._closed = False

    @property
    def size(self) -> int:
        return len(self.replicas)

    # -- state ------------------------------------------------------------------------
    def _up(self) -> list[bool]:
        return [i not in self._down and not r.is_dead for i, r in enumerate(self.replicas)]

    @property
    def is_dead(self) -> bool:
        """No replica can take a request now (dead or restarting)."""
        return self._closed or not any(self._up())

    @property
    def dead_error(self) -> str | None:
        if self._closed:
            return "the server was shut down"
        return f"all {self.size} replicas are down (restarting)" if self.is_dead else None

    @property
    def num_unfinished(self) -> int:
        return len(self._where)

    @property
    def info(self) -> CoreInfo:
        """The replicas' engine, with the smallest KV cache among them: a request admitted
        here fits whichever replica it is routed to (replicas sharing a GPU size theirs
        against what the earlier ones hold)."""
        return msgspec.structs.replace(self.replicas[0].info,
                                       num_kv_blocks=min(r.info.num_kv_blocks for r in self.replicas))

    # -- requests ---------------------------------------------------------------------
    def validate(self, prompt, sampling_params: SamplingParams | None = None) -> ValidatedRequest:
        """The front door (`frontend.prompts.validate_request`), once for every replica."""
        return validate_request(prompt, sampling_params, self.tokenizer, self.info)

    async def generate(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
                       *, output_kind: OutputKind = OutputKind.DELTA, stream_interval: int = 1):
        """AsyncLLM.generate over the replicas: the request is validated here, routed by its
        token ids, and handed to its replica as a ValidatedRequest (not checked again), with
        its output kind and stream interval."""
        self._start_watcher()
        request_id = str(request_id) if request_id is not None else f"dp-{next(self._ids)}"
        if request_id in self._where:
            raise ValueError(f"request id {request_id!r} is already in use")
        try:
            request = await admit_request(self.validate, prompt, sampling_params, self.tokenize_off_loop_chars)
        except RequestRejected as e:  # fails alone, as an output
            yield e.output(request_id, time.time())
            return
        try:
            i = self.router.pick(request.prompt_token_ids, self._up())
        except LookupError:
            raise EngineDeadError(self.dead_error or "no replica is up") from None
        replica = self.replicas[i]
        self._where[request_id] = i
        try:
            async for out in replica.generate(request, request_id=request_id, output_kind=output_kind,
                                              stream_interval=stream_interval):
                if out.finished and out.error and replica.is_dead:
                    raise EngineDeadError(self._death(i, out.error))
                yield out
        except EngineDeadError as e:
            if replica.is_dead:
                raise EngineDeadError(self._death(i, str(e))) from None
            raise
        finally:
            self.router.finish(i)
            self._where.pop(request_id, None)

    def _death(self, i: int, why: str) -> str:
        if not why.startswith(f"replica {i}"):
            why = f"replica {i} of {self.size} died ({why}); it is being restarted: retry the request"
        return why

    async def abort(self, request_id: str) -> None:
        i = self._where.get(request_id)
        if i is not None:
            await self.replicas[i].abort(request_id)

    async def stats(self) -> dict:
        """The replicas' engine stats summed, and each replica's under "replicas"."""
        self._start_watcher()
        up = self._up()
        results = await asyncio.gather(*(r.stats() if up[i] else _none() for i, r in enumerate(self.replicas)),
                                       return_exceptions=True)
        per = []
        for i, res in enumerate(results):
            s = dict(res) if isinstance(res, dict) else {}
            load = self.router.loads[i]
            s.update(replica=i, up=bool(up[i] and isinstance(res, dict)), routed=load.routed,
                     affine=load.affine, outstanding=load.outstanding, restarts=self.restarts[i])
            per.append(s)
        total = {k: sum(s.get(k) or 0 for s in per) for k in SUMMED}
        # the grammar's and speculation's counters, where a replica reports them; the
        # acceptance ratios are the summed counters' (SpecStats), not a sum of ratios
        for k in sorted({k for s in per for k in s if k.startswith(_COUNTER_PREFIXES)} - set(_SPEC_RATIOS)):
            total[k] = sum(s.get(k) or 0 for s in per)
        if "spec_num_draft_tokens" in total:
            total.update(SpecStats(*(total[k] for k in _SPEC_COUNTERS)).as_dict())
        blocks = total["kv_blocks_total"]
        total["kv_cache_usage"] = total["kv_blocks_in_use"] / blocks if blocks else 0.0
        q = total["prefix_cache_queries"]
        total["prefix_cache_hit_rate"] = total["prefix_cache_hits"] / q if q else 0.0
        total["replicas"] = per
        return total

    async def reset_prefix_cache(self) -> None:
        up = self._up()
        await asyncio.gather(*(r.reset_prefix_cache() for i, r in enumerate(self.replicas) if up[i]))
        for i in range(self.size):
            self.router.forget(i)

    # -- restarts ---------------------------------------------------------------------
    def _start_watcher(self) -> None:
        if not self._closed and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while not self._closed:
            for i, r in enumerate(self.replicas):
                if i not in self._down and r.is_dead:
                    self._down.add(i)
                    self.router.forget(i)
                    asyncio.get_running_loop().create_task(self._restart(i))
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def _restart(self, i: int) -> None:
        old = self.replicas[i]
        log.warning("replica %d died (%s); restarting it", i, old.dead_error)
        try:
            await old.shutdown()
        except Exception:  # noqa: BLE001 - it is gone already
            pass
        loop = asyncio.get_running_loop()
        while not self._closed:
            try:
                new = await loop.run_in_executor(None, self._make, i)
                await new.stats()  # its output reader runs (so a next death is seen)
            except Exception as e:  # noqa: BLE001 - try again; the others keep serving
                log.error("replica %d did not restart: %s", i, e)
                await asyncio.sleep(5.0)
                continue
            if self._closed:
                await new.shutdown()
                return
            self.replicas[i] = new
            self.restarts[i] += 1
            self._down.discard(i)
            log.warning("replica %d restarted", i)
            return

    # -- shutdown ---------------------------------------------------------------------
    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None:
            self._watcher.cancel()
        await asyncio.gather(*(r.shutdown() for r in self.replicas), return_exceptions=True)

    def close(self) -> None:
        self._closed = True
        for r in self.replicas:
            r.close()

    async def __aenter__(self) -> "DataParallelLLM":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()


def _on_cpu(engine_options: dict) -> bool:
    device = engine_options.get("device", "auto")
    if device == "auto":
        import torch
        return not torch.cuda.is_available()
    return device == "cpu"


async def _none():
    return None
