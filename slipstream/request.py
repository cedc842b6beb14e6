"""Per-request state, and what a finished or streaming request reports back."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Hashable

from slipstream.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[dict[int, float]] | None = None  # per token: {sampled id and top-k ids: logprob}
    error: str | None = None
    prompt: str | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    detokenizer: object | None = None  # IncrementalDetokenizer when text is needed while running

    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    error: str | None = None

    # Scheduling state.  Tokens [0, num_computed) have their KV written (or being written
    # by a launched batch); `num_pending` sampled tokens are still in flight.
    num_computed: int = 0
    num_pending: int = 0
    last_sample: tuple[int, int] = (-1, -1)  # (batch id, sample row) of the newest pending token
    block_ids: list[int] = field(default_factory=list)
    block_keys: list[Hashable] = field(default_factory=list)  # keys of registered full blocks
    row: int = -1  # row in the request table while running

    @property
    def num_tokens(self) -> int:
        """Known tokens: the prompt and the outputs received so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return self.num_tokens + self.num_pending

    @property
    def num_scheduled_outputs(self) -> int:
        return len(self.output_token_ids) + self.num_pending

    @property
    def all_done_scheduling(self) -> bool:
        """max_tokens is known in advance: no batch needs to draw more than it."""
        return self.num_scheduled_outputs >= self.params.max_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
