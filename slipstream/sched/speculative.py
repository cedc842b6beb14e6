"""Speculative decoding's scheduling half: which rows draft, how many tokens, and what the
accepted counts do to a request's state.

A decode row that drafts m tokens (1 <= m <= k) computes 1 + m query tokens this step: its
last token and the drafts, at positions L-1 .. L-1+m (L = its known tokens).  The drafts are
written into the request table past the known tokens, where the batch's inputs are gathered
from, and KV slots are reserved for all of them.  The step's verification emits 1 .. m+1
tokens; `Scheduler.update` appends them (stop tokens and max_tokens cut the list) and trims
`num_computed` back to the tokens whose KV holds accepted inputs (L - 1 + emitted), so the
rejected drafts' KV entries are rewritten by later steps and never read: every later query
is at a position at or below the next written one.

Rows that draft nothing this step run as plain decode rows.  A row never drafts while
min_tokens still masks its stop tokens, or while any request has a grammar
(a constrained batch samples late, `StepLoop._sample_deferred`): such rows keep their exact
meaning and are just not sped up.  Above `disable_by_batch_size` running rows no row drafts.

Synchronous loop: the drafts are proposed here (`propose_ngram` over the known tokens), and
a step with drafts is completed before the next is scheduled (`Scheduler.drafting`).

Asynchronous loop (`device`): the next step is scheduled before this one's accepted counts
are known.  A row is laid out as if every step in flight emits one token (`num_computed` =
known tokens - 1 + steps in flight, as in plain decoding), a row that may draft gets k draft
slots whose tokens the GPU proposes (runner/spec_device.py), and a row whose step in flight
verifies drafts (`verifying`) is marked to be shifted on the GPU by that step's emitted
count - 1, its KV reserved for the k extra positions.  `synced` tracks whose device token
history holds every known token (plain steps write none).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slipstream.sched.request import Request
from slipstream.spec.config import SpeculativeConfig


@dataclass
class SpecBatch:
    """The drafts of a batch's sampling rows (rows that draft nothing have 0)."""
    k: int  # columns of draft_tokens: the configured num_speculative_tokens
    # int32 [S, k], -1 past a row's drafts; None: the GPU drafts them (device drafting)
    draft_tokens: np.ndarray | None
    num_drafts: np.ndarray  # int32 [S]: host drafts, or the GPU's draft slots (k or 0)
    # device drafting: per sequence row, the previous batch's sample row whose emitted count
    # shifts this row (positions, lengths, slots, token index), or -1
    shift_src: np.ndarray | None = None
    # device drafting: (table row, known tokens) to write into the device token history first
    history_resets: list[tuple[int, list[int]]] = field(default_factory=list)
    min_n: int = 1  # n-gram lengths the GPU's drafter matches
    max_n: int = 1
    # draft_model, eagle3 (synchronous loop): each drafting row's q, float32 [m, V] on the
    # device, in row order (opaque here: the runner's drafter made them, the runner stacks
    # them); None: point-mass drafts
    draft_probs: list | None = None
    # `slipstream bench --spec-synthetic-accept A` only: every verification accepts the first
    # min(A, drafted) drafts whatever the target says (the tokens are then not the model's)
    bench_synthetic_accept: float | None = None


@dataclass
class SpecStats:
    """Counters since the engine started (the engine's stats, /metrics, `slipstream bench`)."""
    num_spec_steps: int = 0  # verification steps: batches with at least one draft
    num_drafting_rows: int = 0  # row-steps that carried drafts
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # drafts accepted (the emitted tokens past the first)
    num_emitted_tokens: int = 0  # tokens the drafting rows emitted (accepted + 1 each)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafting row emits per step (1 = no draft ever accepted)."""
        return self.num_emitted_tokens / self.num_drafting_rows if self.num_drafting_rows else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict:
        return dict(spec_num_steps=self.num_spec_steps, spec_num_drafting_rows=self.num_drafting_rows,
                    spec_num_draft_tokens=self.num_draft_tokens,
                    spec_num_accepted_tokens=self.num_accepted_tokens,
                    spec_num_emitted_tokens=self.num_emitted_tokens,
                    spec_mean_accepted_length=self.mean_accepted_length,
                    spec_acceptance_rate=self.acceptance_rate)


class SpecScheduling:
    """The drafter (n-gram prompt lookup over the request's own tokens, on the host) and the
    per-request rules of who drafts how many."""

    @staticmethod
    def check(config: SpeculativeConfig, tensor_parallel_size: int) -> None:
        """One-line errors for what the engine cannot run yet (before any weight loads)."""
        if config.method not in ("ngram", "draft_model", "eagle3"):
            raise ValueError(f"speculative_config.method {config.method!r} is not supported by the "
                             "engine yet; use 'ngram', 'draft_model' or 'eagle3'")
        if tensor_parallel_size > 1:
            raise ValueError("speculative_config needs tensor_parallel_size=1 for now")

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.check(config, 1)
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        # eagle3, draft_model: the drafter runs after every step (runner/device_drafter.py), so every
        # step is a speculative one, and its drafts wait on the device, k a row
        self.every_step = config.method in ("eagle3", "draft_model")
        self.stats = SpecStats()
        # device drafting (asynchronous scheduling): the GPU drafts from a device-side token
        # history right before the step, once the previous step's accepted tokens are there
        self.device = False
        self.verifying: set[Request] = set()  # requests whose newest step in flight verifies drafts
        self.synced: set[Request] = set()  # requests whose device token history is complete
        # draft_model, eagle3: the runner's drafter (runner/device_drafter.py), set by the engine core;
        # its q of each host draft array, until the batch takes them
        self.drafter = None
        self._probs: dict[int, tuple[np.ndarray, object]] = {}
        # a benchmark knob, set by `slipstream bench` only (EngineCore.set_bench_synthetic_acceptance):
        # accept min(A, drafted) drafts a step regardless of the target, and draft k tokens
        # a row even where the n-gram lookup finds none (the last token repeated)
        self.bench_synthetic_accept: float | None = None

    def forget(self, req: Request) -> None:
        """`req` left the running set (finished or preempted): its row goes back."""
        self.verifying.discard(req)
        self.synced.discard(req)
        if self.drafter is not None:
            self.drafter.forget(req)

    def unsynced(self, requests) -> None:
        """A plain step ran these requests: their device histories miss its tokens."""
        for req in requests:
            self.synced.discard(req)

    def may_verify(self, req: Request, budget: int, tokens: np.ndarray) -> bool:
        """Device drafting: whether `req` gets k draft slots this step.  Its true position is
        unknown by up to k (its step in flight may accept k drafts), so its KV is reserved
        for 1 + 2k tokens, within the context.  Only a row whose known `tokens` already end
        in an n-gram seen before gets slots: the GPU's lookup (over these and the tokens in
        flight) rarely finds one otherwise, and a row with slots makes the step a
        verification step (eager, k + 1 query tokens a row) even when it drafts nothing."""
        p = req.params
        if not (req.num_pending <= 1 and budget >= self.k
                and req.num_scheduled_outputs >= p.min_tokens
                and req.num_computed + 1 + 2 * self.k <= self.max_model_len):
            return False
        if self.bench_synthetic_accept is not None or self.every_step:
            return True
        from slipstream.spec.ngram import has_ngram_match
        return has_ngram_match(tokens, self.config.prompt_lookup_min)

    def enabled_for(self, num_running: int, requests) -> bool:
        """Whether this step drafts at all: within disable_by_batch_size, and no grammar."""
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running > limit:
            return False
        return not any(r.grammar is not None for r in requests)

    def max_drafts(self, req: Request) -> int:
        """How many drafts `req` may carry this step: 0 unless it is a synchronous decode
        row whose draws keep their meaning with drafts, and never past max_tokens (every
        emitted token counts) or the context."""
        p = req.params
        if (req.num_pending or req.num_computed != req.num_tokens - 1
                or req.num_scheduled_outputs < p.min_tokens):
            return 0
        if self.every_step:  # all k or none, as the asynchronous loop's draft slots (may_verify),
            # so that both loops verify the same drafts (the tokens past max_tokens are cut)
            fits = req.num_computed + 1 + 2 * self.k <= self.max_model_len
            return self.k if fits else 0
        return max(0, min(self.k, p.max_tokens - req.num_scheduled_outputs - 1,
                          self.max_model_len - req.num_tokens))

    def propose(self, req: Request, tokens: np.ndarray, limit: int) -> np.ndarray:
        """Up to `limit` drafts continuing `tokens` (the request's known tokens)."""
        if self.drafter is not None:
            p = req.params
            drafts, q = self.drafter.propose(req, tokens, limit, p.temperature, req.seed,
                                             req.num_scheduled_outputs)
            self._probs[id(drafts)] = (drafts, q)
            return drafts
        from slipstream.spec.ngram import propose_ngram
        c = self.config
        drafts = propose_ngram(tokens, self.k, c.prompt_lookup_min, c.prompt_lookup_max)
        if self.bench_synthetic_accept is not None:  # every row drafts: the last token repeated
            drafts = list(drafts) + [int(tokens[-1])] * (self.k - len(drafts))
        return np.asarray(drafts, np.int32)[:limit]

    def batch(self, drafts: list, shift: list[int] | None, requests: list[Request]) -> SpecBatch | None:
        """The batch's SpecBatch from each sampling row's drafts (host drafts, or the count of
        the GPU's draft slots) and, with device drafting, each sequence row's shift source;
        None when no row drafts and none shifts."""
        if self.device:
            num = np.array(drafts, np.int32)
            shift_src = np.array(shift, np.int32)
            if not num.any() and not (shift_src >= 0).any() and not self.every_step:
                self.unsynced(requests)
                return None
            if num.any():
                self.stats.num_spec_steps += 1
            resets = [(r.row, r.token_ids()) for r in requests if r not in self.synced]
            self.synced.update(requests)
            c = self.config
            return SpecBatch(self.k, None, num, shift_src, resets, c.prompt_lookup_min, c.prompt_lookup_max,
                             bench_synthetic_accept=self.bench_synthetic_accept)
        drafts = [d for d in drafts]
        if not any(not isinstance(d, int) for d in drafts) and not self.every_step:  # (an int: no drafts)
            return None
        S = len(drafts)
        tokens = np.full((S, self.k), -1, np.int32)
        num = np.zeros(S, np.int32)
        probs = []
        for j, d in enumerate(drafts):
            if not isinstance(d, int):
                tokens[j, :len(d)] = d
                num[j] = len(d)
                if self.drafter is not None:
                    probs.append(self._probs[id(d)][1])
        self._probs.clear()
        self.stats.num_spec_steps += 1
        return SpecBatch(self.k, tokens, num, draft_probs=probs or None,
                         bench_synthetic_accept=self.bench_synthetic_accept)

    def record(self, num_drafts: int, num_emitted: int) -> None:
        s = self.stats
        s.num_drafting_rows += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_emitted - 1
        s.num_emitted_tokens += num_emitted
