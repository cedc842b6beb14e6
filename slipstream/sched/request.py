"""A request's state inside the engine core (the front ends keep their own: frontend/)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable

from slipstream.sampling.params import SamplingParams

if TYPE_CHECKING:
    from slipstream.sampling.grammar.compiler import GrammarHandle
    from slipstream.sampling.grammar.matcher import GrammarMatcher


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = 0.0  # time.time() when the front end sent it

    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    error: str | None = None
    stop_token: int | None = None  # the token that ended it with "stop"
    # prompt logprobs (params.prompt_logprobs): entries for prompt tokens 1..len-1, in order
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)
    queue_time: float | None = None  # seconds from arrival to its first scheduled step
    queue_time_sent: bool = False

    # What the core has reported to the front end so far (output tokens, prompt logprobs).
    num_emitted: int = 0
    num_prompt_logprobs_emitted: int = 0

    # Scheduling state.  Tokens [0, num_computed) have their KV written (or being written
    # by a launched batch); `num_pending` sampled tokens are still in flight.
    num_computed: int = 0
    num_pending: int = 0
    last_sample: tuple[int, int] = (-1, -1)  # (batch id, sample row) of the newest pending token
    block_ids: list[int] = field(default_factory=list)
    block_keys: list[Hashable] = field(default_factory=list)  # keys of registered full blocks
    # block_ids[:num_freed_blocks] slid out of the window of every later query and went back
    # early (a model whose every layer is windowed: Scheduler's sliding_window)
    num_freed_blocks: int = 0
    row: int = -1  # row in the request table while running
    # structured outputs (sched/structured_outputs.py): the grammar's compile, then the matcher
    # that has accepted exactly output_token_ids
    grammar: GrammarHandle | None = None
    matcher: GrammarMatcher | None = None

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
    def awaiting_grammar(self) -> bool:
        """Its grammar is still compiling: it is not scheduled yet."""
        return self.grammar is not None and self.matcher is None

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
