"""The messages between front ends and the engine core: small msgspec structs, sent as
msgpack over ZMQ (no pickles on the wire).

Front end -> core: `AddRequest`, `Abort`, `Call` (a utility: stats, ...), `Shutdown`.
Core -> front end: `Ready` / `StartupFailed` once, then `StepOutputs` after each step
that gave tokens, `CallResult` for each `Call`, and `CoreDead` when a step raised.
"""
from __future__ import annotations

from typing import Union

import msgspec


class CoreInfo(msgspec.Struct, frozen=True):
    """What a front end needs to know of the engine it talks to."""
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_kv_blocks: int
    block_size: int
    device: str
    async_scheduling: bool
    max_num_batched_tokens: int


class AddRequest(msgspec.Struct, tag="add", array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    params: dict  # SamplingParams.to_dict(); n is handled by the front end (one AddRequest each)
    seed: int | None = None  # None: the core draws one from its config seed
    arrival_time: float = 0.0  # time.time() at the front end


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class Call(msgspec.Struct, tag="call", array_like=True):
    call_id: int
    method: str  # one of EngineCore.UTILITIES
    args: list = []


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's news after a step: tokens since its previous output, their logprobs
    when asked (per token {sampled id: lp, top-k id: lp, ...}), prompt logprobs computed
    this step (entries for prompt tokens 1, 2, ... in order), and the end."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    new_prompt_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_token: int | None = None  # the token id that ended it with "stop"
    error: str | None = None
    queue_time: float | None = None  # seconds it waited before its first step (first output)


class StepOutputs(msgspec.Struct, tag="out", array_like=True):
    outputs: list[CoreOutput]


class CallResult(msgspec.Struct, tag="result", array_like=True, omit_defaults=True):
    call_id: int
    result: Union[dict, list, str, int, float, bool, None] = None
    error: str | None = None


class Ready(msgspec.Struct, tag="ready", array_like=True):
    info: CoreInfo


class StartupFailed(msgspec.Struct, tag="startup_failed", array_like=True):
    message: str
    kind: str = "RuntimeError"  # the exception's class: ValueError, FileNotFoundError, ...


class CoreDead(msgspec.Struct, tag="dead", array_like=True):
    """The core died: `outputs` end every request it held, in the same message as the
    death, so no request can arrive at a front end between the two and wait forever."""
    message: str
    outputs: list[CoreOutput] = []


ToCore = Union[AddRequest, Abort, Call, Shutdown]
FromCore = Union[StepOutputs, CallResult, Ready, StartupFailed, CoreDead]

encoder = msgspec.msgpack.Encoder()
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_decoder = msgspec.msgpack.Decoder(FromCore)
