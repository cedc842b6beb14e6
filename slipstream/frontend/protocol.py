"""`EngineClient`: what the HTTP server, run-batch and the data-parallel router use of an
engine, typed once.

`AsyncLLM` (one engine core), `DataParallelLLM` (replicas behind a router), `RayReplica`
(an engine in a Ray actor) and the tests' `FakeAsyncLLM` implement it. A caller validates a
request once through `validate` (the front door, `frontend.prompts.validate_request`) and
passes the `ValidatedRequest` to `generate`, which does not check it again.
"""
from __future__ import annotations

from typing import AsyncIterator, Protocol, runtime_checkable

from slipstream.core.messages import CoreInfo
from slipstream.frontend.outputs import OutputKind, RequestOutput
from slipstream.frontend.prompts import ValidatedRequest
from slipstream.model.tokenizer import Tokenizer
from slipstream.sampling.params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    tokenizer: Tokenizer | None  # None: a model without one (dummy weights): token-id prompts only
    info: CoreInfo  # what the engine reports: its limits, its KV cache (admission reads them)
    model_name: str
    max_model_len: int
    vocab_size: int
    dead_error: str | None  # why the engine is dead (None while it lives)

    @property
    def is_dead(self) -> bool:
        """The engine can take no request now."""

    def validate(self, prompt, sampling_params: SamplingParams | None = None) -> ValidatedRequest:
        """The front door: a ValidatedRequest, or a one-line TypeError / ValueError."""

    def generate(self, prompt, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, *, output_kind: OutputKind = OutputKind.DELTA,
                 stream_interval: int = 1) -> AsyncIterator[RequestOutput]:
        """An async generator of outputs as tokens arrive; `prompt` is a ValidatedRequest
        (with no sampling_params beside it), a text or token ids. Leaving it early aborts
        the request. `output_kind` and `stream_interval`: what each output carries and how
        often one comes (frontend/outputs.py)."""

    async def abort(self, request_id: str) -> None:
        """End a request now; its stream ends with finish_reason "abort"."""

    async def stats(self) -> dict:
        """The engine's counters (num_running, num_waiting, kv_blocks_in_use, ...)."""

    async def reset_prefix_cache(self) -> None:
        """Forget cached prefixes (refused while requests run)."""

    async def shutdown(self) -> None:
        """End every open request and stop the engine."""

    def close(self) -> None:
        """Stop the engine from outside an event loop."""
