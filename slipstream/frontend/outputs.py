"""What a request reports to its caller, as it streams and when it ends."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str = ""  # cumulative; stop strings trimmed, never a broken UTF-8 character
    token_ids: list[int] = field(default_factory=list)
    new_text: str = ""  # since the previous output of this request
    new_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # None while running; "stop" | "length" | "abort" | "error"
    # per token {sampled id: logprob, then the top-k ids in rank order: logprob}
    logprobs: list[dict[int, float]] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float  # time.time() when it was submitted
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    queue_time_s: float | None = None  # waited in the core before its first step


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # SamplingParams.n of them, by index
    finished: bool
    error: str | None = None
    # SamplingParams(prompt_logprobs=k): one entry per prompt token, None for the first; each
    # {the prompt token: logprob, then the top-k ids: logprob}
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: RequestMetrics | None = None

    # the first completion, for n == 1
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def new_text(self) -> str:
        return self.outputs[0].new_text

    @property
    def new_token_ids(self) -> list[int]:
        return self.outputs[0].new_token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs
