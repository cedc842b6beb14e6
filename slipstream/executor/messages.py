"""The messages between the engine core and its tensor-parallel workers: msgspec structs over
ZMQ (no pickles); a step also carries two raw frames, its packed int32 and float32 inputs
(IOSlot.pack).

Core -> each rank: `Allocate` (setup phase 2), `Step` + 2 frames, `Stop`.
Rank -> core: `Profiled` (phase 1: its KV block count), `WorkerReady` (phase 3 done),
`StepDone` (rank 0 only: the sampled tokens), `WorkerFailed`.
"""
from __future__ import annotations

from typing import Union

import msgspec


class Allocate(msgspec.Struct, tag="allocate", array_like=True):
    num_blocks: int  # the smallest count over the ranks


class Step(msgspec.Struct, tag="step", array_like=True, omit_defaults=True):
    """A launch: the StepShape, the real sizes, and what is not in the packed inputs."""
    batch_id: int
    num_tokens: int  # the StepShape (padded sizes) ...
    num_seqs: int
    num_samples: int
    max_query_len: int
    max_seq_len: int
    use_top_k_top_p: bool
    use_penalties: bool
    num_logprobs: int
    padded: bool
    num_decode: int
    num_rows: int  # ... the real rows, block-table columns and sampling rows
    block_cols: int
    num_results: int
    suppress: list[tuple[int, list[int]]] = []
    penalty_resets: list[tuple[int, list[int], list[int]]] = []
    prompt_spans: list[tuple[int, int, list[int], int]] = []  # (first, count, targets, k)


class Stop(msgspec.Struct, tag="stop", array_like=True):
    pass


class Profiled(msgspec.Struct, tag="profiled", array_like=True):
    rank: int
    num_blocks: int


class WorkerReady(msgspec.Struct, tag="ready", array_like=True):
    rank: int


class StepDone(msgspec.Struct, tag="done", array_like=True, omit_defaults=True):
    batch_id: int
    tokens: bytes  # int32 [S]
    num_logprobs: int = 0
    logprobs: bytes = b""  # float32 [S, 1 + k]
    logprob_ids: bytes = b""  # int32 [S, k]
    prompt_logprobs: list[tuple[bytes, bytes, int]] = []  # (float32 [m, 1 + k], int32 [m, k], m)


class WorkerFailed(msgspec.Struct, tag="failed", array_like=True):
    rank: int
    message: str


ToWorker = Union[Allocate, Step, Stop]
FromWorker = Union[Profiled, WorkerReady, StepDone, WorkerFailed]

encoder = msgspec.msgpack.Encoder()
to_worker = msgspec.msgpack.Decoder(ToWorker)
from_worker = msgspec.msgpack.Decoder(FromWorker)
