"""Every engine the server runs on is an `EngineClient` (frontend/protocol.py): AsyncLLM,
DataParallelLLM, the Ray replica and the tests' fake. `isinstance` (runtime_checkable) sees a
missing member; the signature check also sees a renamed parameter or a sync method where the
protocol has an async one."""
from __future__ import annotations

import inspect

import msgspec
import pytest
from fake_async_llm import FakeAsyncLLM

from slipstream.frontend.async_llm import AsyncLLM
from slipstream.frontend.data_parallel import DataParallelLLM
from slipstream.frontend.protocol import EngineClient
from slipstream.ray.serving import RayReplica

METHODS = {name: fn for name, fn in vars(EngineClient).items()
           if inspect.isfunction(fn) and not name.startswith("_")}
PROPERTIES = {name for name, v in vars(EngineClient).items() if isinstance(v, property)}


def _shape(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _kind(fn) -> str:
    if inspect.isasyncgenfunction(fn):
        return "async generator"
    return "coroutine" if inspect.iscoroutinefunction(fn) else "plain"


def mismatches(cls) -> list[str]:
    """How `cls` departs from EngineClient's methods and properties ([] when it conforms)."""
    out = []
    for name, proto in METHODS.items():
        impl = inspect.getattr_static(cls, name, None)
        if impl is None or not inspect.isfunction(impl):
            out.append(f"{name}: missing")
            continue
        if _shape(impl) != _shape(proto):
            out.append(f"{name}: {_shape(impl)} instead of {_shape(proto)}")
        want = "async generator" if name == "generate" else _kind(proto)
        if _kind(impl) != want:
            out.append(f"{name}: {_kind(impl)} instead of {want}")
    for name in PROPERTIES:
        if not isinstance(inspect.getattr_static(cls, name, None), property):
            out.append(f"{name}: not a property")
    return out


def test_the_protocol_names_what_the_server_uses():
    assert set(METHODS) == {"validate", "generate", "abort", "stats", "reset_prefix_cache", "shutdown", "close"}
    assert PROPERTIES == {"is_dead"}
    assert {"tokenizer", "info", "model_name", "max_model_len", "vocab_size", "dead_error"} <= set(
        EngineClient.__annotations__)


@pytest.mark.parametrize("cls", [AsyncLLM, DataParallelLLM, RayReplica, FakeAsyncLLM])
def test_every_engine_client_has_the_protocols_methods(cls):
    assert mismatches(cls) == []


def test_a_missing_or_renamed_method_is_seen():
    missing = type("NoStats", (), {k: v for k, v in vars(FakeAsyncLLM).items() if k != "stats"})
    assert mismatches(missing) == ["stats: missing"]

    class Renamed(FakeAsyncLLM):
        async def abort(self, rid: str) -> None:  # (the parameter's name differs)
            pass

        def stats(self) -> dict:  # (not a coroutine)
            return {}

    assert sorted(m.split(":")[0] for m in mismatches(Renamed)) == ["abort", "stats"]
    assert not isinstance(missing.__new__(missing), EngineClient)


def test_the_fake_and_data_parallel_over_fakes_are_engine_clients():
    fake = FakeAsyncLLM()
    assert isinstance(fake, EngineClient)
    dp = DataParallelLLM(lambda i: FakeAsyncLLM(), 2)
    assert isinstance(dp, EngineClient)


def test_async_llm_is_an_engine_client(tokenized_tiny):
    llm = AsyncLLM(tokenized_tiny, core="thread", device="cpu", max_model_len=128, max_num_seqs=4)
    try:
        assert isinstance(llm, EngineClient)
    finally:
        llm.close()


def test_the_ray_replica_is_an_engine_client(monkeypatch):
    """(its actor stood in for: the members are the replica's own, set up without a cluster)"""
    import ray

    import slipstream.ray.serving as serving

    info = FakeAsyncLLM().info

    class Handle:
        def remote(self, *args):
            return msgspec.msgpack.encode(info)

    class Actor:
        info = Handle()

    class ActorClass:
        def options(self, **kw):
            return self

        def remote(self, model, options):
            return Actor()

    monkeypatch.setattr(serving, "_actor_class", lambda ray: ActorClass())
    monkeypatch.setattr(ray, "get", lambda ref: ref)
    replica = RayReplica(None, {"load_format": "dummy"}, {})
    assert isinstance(replica, EngineClient) and replica.info == info and replica.tokenizer is None


def test_data_parallel_sums_the_replicas_grammar_and_speculation_counters():
    """/metrics of a data-parallel server: counters summed, acceptance ratios recomputed."""
    import asyncio

    class Replica(FakeAsyncLLM):
        def __init__(self, drafts: int, accepted: int, rows: int, emitted: int):
            super().__init__()
            self.spec = dict(spec_num_steps=rows, spec_num_drafting_rows=rows, spec_num_draft_tokens=drafts,
                             spec_num_accepted_tokens=accepted, spec_num_emitted_tokens=emitted,
                             spec_mean_accepted_length=emitted / rows, spec_acceptance_rate=accepted / drafts,
                             grammar_compiled=2, grammar_cache_hits=3, constrained_requests=5)

        async def stats(self) -> dict:
            return {**await super().stats(), **self.spec}

    replicas = [Replica(30, 10, 10, 20), Replica(10, 10, 5, 15)]
    dp = DataParallelLLM(lambda i: replicas[i], 2)
    total = asyncio.run(dp.stats())
    assert total["spec_num_draft_tokens"] == 40 and total["spec_num_accepted_tokens"] == 20
    assert total["spec_acceptance_rate"] == 0.5  # 20 / 40, not the mean of 1/3 and 1
    assert total["spec_mean_accepted_length"] == 35 / 15
    assert total["grammar_compiled"] == 4 and total["grammar_cache_hits"] == 6 and total["constrained_requests"] == 10
