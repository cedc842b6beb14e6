"""Output processing in the front end: core outputs (token ids) -> what callers see.

For every request: incremental detokenization (text deltas never hold a broken UTF-8
character), stop strings (a hit ends the completion here and asks the core to abort it;
the tokens the core drew one step late are dropped), the n completions of one prompt,
logprobs and prompt logprobs, and timing.  The core never sees text.

It also decides what each output says (`OutputKind`, chosen per request): the deltas since
the previous output, one output per `stream_interval` tokens of a completion (always one at
its end), and the whole completion once, on its finishing output.  So a stream of n tokens
costs O(n) here and in whatever formats the outputs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from slipstream.core.messages import AddRequest, CoreOutput
from slipstream.frontend.detokenizer import IncrementalDetokenizer
from slipstream.frontend.outputs import CompletionOutput, OutputKind, RequestMetrics, RequestOutput
from slipstream.sampling.params import SamplingParams, completion_seed


@dataclass(eq=False)
class CompletionState:
    index: int
    core_id: str
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    sent_tokens: int = 0  # token_ids[:sent_tokens] went out in earlier outputs
    new_text: list[str] = field(default_factory=list)  # released since the previous output
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    finish_sent: bool = False  # its finishing output went out

    def finish(self, reason: str, stop_reason=None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason

    def due(self, stream_interval: int) -> bool:
        """Whether it has news for a DELTA output: `stream_interval` new tokens, or its end."""
        if self.finish_sent:
            return False
        return self.finish_reason is not None or len(self.token_ids) - self.sent_tokens >= stream_interval

    def output(self) -> CompletionOutput:
        """Its deltas since the previous output (which it marks sent); once it finished, the
        whole completion too: its lists themselves, no longer appended to."""
        start, end = self.sent_tokens, len(self.token_ids)
        self.sent_tokens = end
        new_text = "".join(self.new_text) if self.new_text else ""
        self.new_text = []
        whole = {}
        if self.finish_reason is not None:
            self.finish_sent = True
            whole = dict(token_ids=self.token_ids, logprobs=self.logprobs,
                         text=self.detokenizer.text if self.detokenizer is not None else "")
        return CompletionOutput(self.index, self.token_ids[start:end], new_text,
                                self.logprobs[start:end] if self.logprobs is not None else None,
                                self.finish_reason, self.stop_reason, **whole)


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[CompletionState]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None
    waiter: object = None  # the front end's wake-up (an asyncio.Event in AsyncLLM)
    output_kind: OutputKind = OutputKind.DELTA
    stream_interval: int = 1  # DELTA: an output per this many new tokens of a completion
    final_sent: bool = False  # its last output went out

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def has_output(self) -> bool:
        """Whether an output is due: under FINAL_ONLY its end, under DELTA news of any
        completion (CompletionState.due)."""
        if self.final_sent:
            return False
        if self.output_kind is OutputKind.FINAL_ONLY:
            return self.finished
        return any(c.due(self.stream_interval) for c in self.completions)

    def output(self) -> RequestOutput:
        """The output due now (`has_output`); it marks what it reports as sent."""
        finished = self.finished
        if self.output_kind is OutputKind.FINAL_ONLY:
            outs = [c.output() for c in self.completions]
        else:
            outs = [c.output() for c in self.completions if c.due(self.stream_interval)]
        self.final_sent = finished
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, finished,
                             self.error, self.prompt_logprobs, self.metrics)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._by_core_id: dict[str, tuple[RequestState, CompletionState]] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def new_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, output_kind: OutputKind = OutputKind.DELTA,
                    stream_interval: int = 1) -> RequestState:
        """A request's state (not registered yet: `add`); `output_kind` and
        `stream_interval` decide its outputs (RequestState.has_output)."""
        output_kind = OutputKind(output_kind)
        if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an int >= 1, got {stream_interval!r}")
        comps = [CompletionState(i, request_id if params.n == 1 else f"{request_id}#{i}",
                                 self._detokenizer(prompt_token_ids, params))
                 for i in range(params.n)]
        for c in comps:
            if params.logprobs is not None:
                c.logprobs = []
        return RequestState(request_id, prompt, prompt_token_ids, params, comps, RequestMetrics(time.time()),
                            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                            output_kind=output_kind, stream_interval=stream_interval)

    def rejected(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 message: str, output_kind: OutputKind = OutputKind.FINAL_ONLY) -> RequestState:
        """The ended state of a request refused at the front door: no detokenizer (its ids
        may be outside the vocabulary, or not fit the tokenizer's integers at all)."""
        comps = [CompletionState(i, request_id, None) for i in range(params.n)]
        state = RequestState(request_id, prompt, prompt_token_ids, params, comps, RequestMetrics(time.time()),
                             output_kind=OutputKind(output_kind))
        self.fail(state, message)
        return state

    def _detokenizer(self, prompt_token_ids, params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens,
                                      min_tokens=params.min_tokens,
                                      include_stop=params.include_stop_str_in_output)

    def add(self, state: RequestState) -> list[AddRequest]:
        """Register a request; the core messages of its completions."""
        if state.request_id in self.requests:
            raise ValueError(f"request id {state.request_id!r} is already in use")
        self.requests[state.request_id] = state
        p = state.params
        base = p.to_dict()
        msgs = []
        for c in state.completions:
            self._by_core_id[c.core_id] = (state, c)
            params = dict(base, n=1, prompt_logprobs=p.prompt_logprobs if c.index == 0 else None)
            seed = None if p.seed is None else completion_seed(p.seed, c.index)
            msgs.append(AddRequest(c.core_id, state.prompt_token_ids, params, seed, state.metrics.arrival_time))
        return msgs

    def fail(self, state: RequestState, message: str) -> None:
        """End a request that never reached the core."""
        state.error = message
        for c in state.completions:
            c.finish("error")

    # -- core outputs -----------------------------------------------------------------
    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestState], list[str]]:
        """Apply one step's outputs; returns the requests that now have an output due
        (RequestState.has_output) and the core ids to abort (completions that hit a stop
        string)."""
        touched: dict[int, RequestState] = {}
        aborts: list[str] = []
        now = time.time()
        for out in outputs:
            entry = self._by_core_id.get(out.request_id)
            if entry is None:  # ended here already (abort, stop string): the core's late news
                continue
            state, comp = entry
            if comp.finish_reason is None:
                self._apply(state, comp, out, aborts, now)
            if comp.finish_reason is not None:
                del self._by_core_id[comp.core_id]
            touched[id(state)] = state
        for state in touched.values():
            if state.finished:
                state.metrics.finished_time = now
                self.requests.pop(state.request_id, None)
        return [s for s in touched.values() if s.has_output()], aborts

    def _apply(self, state: RequestState, comp: CompletionState, out: CoreOutput, aborts: list[str],
               now: float) -> None:
        m = state.metrics
        if out.queue_time is not None:
            m.queue_time_s = out.queue_time
        if out.new_prompt_logprobs and state.prompt_logprobs is not None:
            state.prompt_logprobs.extend(out.new_prompt_logprobs)
        ids = out.new_token_ids
        if ids:
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
        detok = comp.detokenizer
        last = len(ids) - 1
        for i, token in enumerate(ids):
            comp.token_ids.append(token)
            if comp.logprobs is not None and out.new_logprobs:
                comp.logprobs.append(out.new_logprobs[i])
            if detok is None or (i == last and out.stop_token is not None):
                continue  # the token that stopped it is not part of the text
            text, hit = detok.add_token(token)
            if text:
                comp.new_text.append(text)
            if hit:
                comp.finish("stop", detok.stop_hit)
                if out.finish_reason is None:
                    aborts.append(comp.core_id)
                return
        if out.finish_reason is not None:
            if detok is not None:
                tail = detok.finish()
                if tail:
                    comp.new_text.append(tail)
            comp.finish(out.finish_reason, out.stop_token)
            if out.error:
                state.error = out.error

    # -- ending from the front end --------------------------------------------------------
    def abort(self, request_id: str) -> list[str]:
        """End a request here ("abort"); the core ids still running, to abort there."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        ids = []
        for c in state.completions:
            if c.finish_reason is None:
                c.finish("abort")
                ids.append(c.core_id)
            self._by_core_id.pop(c.core_id, None)
        return ids

    def fail_all(self, message: str) -> list[RequestState]:
        """The engine died: every open request ends with an error."""
        states = list(self.requests.values())
        for state in states:
            state.error = state.error or message
            for c in state.completions:
                if c.finish_reason is None:
                    c.finish("error")
        self.requests.clear()
        self._by_core_id.clear()
        return states
