"""What a request reports to its caller, as it streams and when it ends.

`OutputKind` is chosen per request when it is submitted: `DELTA` streams what is new (the
server's streams, `AsyncLLM.generate`'s default), `FINAL_ONLY` gives one output when the
request ends (`LLM.generate`, non-streamed server requests, batch jobs).  Either way a
stream of n tokens costs O(n) in the front end: no output repeats what an earlier one said.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class OutputKind(str, enum.Enum):
    # every output: the completions with news since the previous output (new tokens, at
    # least `stream_interval` of them unless it ends; or its end), each with its deltas
    DELTA = "delta"
    # one output when the request ends, with every completion whole
    FINAL_ONLY = "final_only"


@dataclass
class CompletionOutput:
    """One completion of a request, as one output reports it.

    The deltas (`new_token_ids`, `new_text`, `new_logprobs`) are what this completion got
    since the previous output of its request: under FINAL_ONLY, everything.  The whole
    completion (`token_ids`, `text`, `logprobs`) is set only on the output where it
    finishes, built once there; before that it is None (copying it into every output of a
    stream cost O(n^2)).  `text` has the stop string trimmed and never ends in a broken
    UTF-8 character; logprobs are per token {sampled id: logprob, then the top-k ids in
    rank order: logprob}; `new_logprobs` and `logprobs` stay None unless asked for.  A
    completion made finished without its whole (one that never had an earlier output, e.g.
    a request refused at admission) gets its deltas as the whole.
    """
    index: int
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # None while running; "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    token_ids: list[int] | None = None  # the whole completion: set once it finished
    text: str | None = None
    logprobs: list[dict[int, float]] | None = None

    def __post_init__(self) -> None:
        if self.finish_reason is not None and self.token_ids is None:
            self.token_ids = self.new_token_ids
            self.text = self.new_text if self.text is None else self.text
            self.logprobs = self.new_logprobs if self.logprobs is None else self.logprobs

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
    """One output of a request.  `outputs`: under DELTA the completions with news, by
    index (for n == 1 always the one); under FINAL_ONLY all SamplingParams.n of them, by
    index.  `finished` is set on the request's last output, and only there."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    # SamplingParams(prompt_logprobs=k): one entry per prompt token, None for the first; each
    # {the prompt token: logprob, then the top-k ids: logprob}.  Complete from the first
    # output on; every output of the request shares this one list (read it, never change it)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: RequestMetrics | None = None

    # the first completion, for n == 1
    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int] | None:
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
