"""Continuous batching: who runs this step, with how many tokens.

Policy only: the scheduler never touches device tensors.  Each step it walks the
running requests in arrival order, gives each the tokens it needs (one for a decode,
a chunk for a prefill) within the token budget, allocates their KV blocks (preempting
the newest running requests by recompute when blocks run out), then admits waiting
requests in FCFS order with prefix-cache hits.

It runs one step ahead of the GPU: when batch N+1 is built, batch N's tokens are not
known yet.  A request whose next input is such a pending token gets a placeholder and
a carry-over index (`carry_src`: its sample row in batch N); tokens that arrive for a
request that already finished are dropped; blocks and rows come back late (kv_cache).

Sliding window (`sliding_window`, given only when every layer of the model is windowed):
a query at position p reads keys (p - W, p] only, and queries only move forward, so the
blocks wholly behind the window of a request's first query this step are dead for it: they
are freed as the step is scheduled (late, as every free: an in-flight batch may still read
them), and stay in the prefix cache until evicted.  With one full-attention layer (Gemma 3)
no block is ever dead, and nothing is freed early.
"""
from __future__ import annotations

import time
from collections import deque
from itertools import chain

import numpy as np

from slipstream.sched.batch import BatchResult, ScheduledBatch
from slipstream.sched.block_pool import BlockPool
from slipstream.sched.in_flight import InFlight
from slipstream.sched.request import Request, Status
from slipstream.sched.request_table import RequestTable
from slipstream.sched.spec_steps import SpeculativeSteps
from slipstream.sched.speculative import SpecScheduling
from slipstream.sched.structured_outputs import StructuredOutputs


class _BatchBuilder:
    def __init__(self, batch_id: int) -> None:
        self.batch_id = batch_id
        self.requests: list[Request] = []
        self.start: list[int] = []
        self.num_new: list[int] = []
        self.carry: list[int] = []
        self.sample_seq: list[int] = []
        self.token_index: list[int] = []
        self.sampled: list[Request] = []
        self.penalty_resets: list[tuple[int, list[int], list[int]]] = []
        self.prompt_logprobs: list[tuple[int, int, int, int]] = []
        # per sampling row while rows draft: host drafts, or the count of the GPU's draft slots
        self.drafts: list[np.ndarray | int] | None = None
        self.shift: list[int] | None = None  # per sequence row, with device drafting (SpecBatch.shift_src)


class Scheduler(SpeculativeSteps):
    def __init__(self, pool: BlockPool, table: RequestTable, max_num_seqs: int,
                 max_num_batched_tokens: int, sliding_window: int | None = None) -> None:
        self.pool = pool
        self.table = table
        self.in_flight: InFlight = pool.in_flight
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.sliding_window = sliding_window
        self.block_size = pool.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.next_batch_id = 0
        self.num_preemptions = 0
        # the grammars of constrained requests (the engine core sets it up)
        self.structured_outputs: StructuredOutputs | None = None
        # speculative decoding's drafter and counters (the engine core sets it up when asked)
        self.speculative: SpecScheduling | None = None
        # the last schedule() let rows draft: its batch's successor waits for its accepted
        # counts (StepLoop runs it synchronously)
        self.drafting = False

    # -- requests ---------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """End a request now (stop, length, abort); in-flight tokens of it are dropped."""
        if req.finished:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self._release(req)
        else:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.error = error

    def _release(self, req: Request) -> None:
        self.pool.free(req.block_ids[req.num_freed_blocks:])
        if self.speculative is not None:
            self.speculative.forget(req)
        row = req.row
        self.in_flight.release_later(lambda: self.table.release(row))
        req.block_ids, req.block_keys, req.row, req.num_computed = [], [], -1, 0
        req.num_freed_blocks = 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # -- scheduling -------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        b = _BatchBuilder(self.next_batch_id)
        budget = self.max_num_batched_tokens
        preempted = self.num_preemptions
        stalled = False
        spec = self.speculative
        drafting = allowed = False
        if spec is not None:
            allowed = spec.enabled_for(len(self.running), chain(self.running, self.waiting))
            # (device drafting: rows after a verification step still need their shift)
            drafting = allowed or bool(spec.device and spec.verifying)
            b.drafts, b.shift = ([], [] if spec.device else None) if drafting else (None, None)
            self.drafting = drafting and not spec.device
        # (rows that draft take their own loop: a plain step's loop stays as it is)
        i = len(self.running) if drafting else 0
        if drafting:
            budget, stalled = self._schedule_drafting(b, budget, allowed)
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.all_done_scheduling:
                i += 1
                continue
            n = min(req.num_tokens_with_pending - req.num_computed, budget)
            if not self._reserve(req, req.num_computed + n):
                stalled = req.status is Status.RUNNING
                break
            self._add(b, req, n)
            budget -= n
            i += 1
        if not stalled and self.num_preemptions == preempted:
            budget = self._admit(b, budget)
        if not b.requests:
            return None
        return self._finalize(b)

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        """Give `req` blocks for `num_tokens`, preempting the newest running requests.

        False when `req` itself was preempted, or when the blocks it needs are on their
        way back from in-flight batches (then it waits a step instead of preempting more).
        """
        need = -(-num_tokens // self.block_size) - len(req.block_ids)
        while need > self.pool.num_free:
            if self.pool.num_free + self.pool.num_freeing >= need:
                return False
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            new = self.pool.allocate(need)
            self.table.set_blocks(req.row, len(req.block_ids), new)
            req.block_ids.extend(new)
        return True

    def _admit(self, b: _BatchBuilder, budget: int) -> int:
        bs = self.block_size
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            # FCFS, past requests whose grammar still compiles (they hold up no one)
            req = next((r for r in self.waiting if not r.awaiting_grammar), None)
            if req is None:
                break
            if req.num_pending or not self.table.num_free_rows:
                break  # a token still in flight for it, or rows still coming back late
            if req.grammar is not None and self.speculative is not None and self.speculative.verifying:
                break  # a constrained batch samples late: not beside rows still to be shifted
            tokens = req.token_ids()
            # Leave at least one token to compute: its logits draw the next token.
            keys = self.pool.block_keys(tokens, (len(tokens) - 1) // bs)
            # the logits of cached positions were never computed: prompt logprobs need them
            hits = self.pool.peek(keys) if req.params.prompt_logprobs is None else []
            computed = len(hits) * bs
            n = min(len(tokens) - computed, budget)
            need = -(-(computed + n) // bs) - len(hits)
            if need + self.pool.num_free_among(hits) > self.pool.num_free:
                break
            self.pool.take(hits)
            if req.params.prompt_logprobs is None:
                self.pool.num_queries += len(keys)
            req.row = self.table.acquire(req)
            req.block_ids = hits + self.pool.allocate(need)
            req.block_keys = keys[:len(hits)]
            self.table.set_blocks(req.row, 0, req.block_ids)
            req.num_computed = computed
            req.status = Status.RUNNING
            if req.queue_time is None:
                req.queue_time = max(0.0, time.time() - req.arrival_time) if req.arrival_time else 0.0
            self.waiting.remove(req)
            self.running.append(req)
            if req.params.uses_penalties:  # its row of the device-side penalty state is stale
                b.penalty_resets.append((req.row, req.prompt_token_ids, list(req.output_token_ids)))
            self._add(b, req, n)
            budget -= n
        return budget

    def _add(self, b: _BatchBuilder, req: Request, n: int, num_drafts: int = 0,
             drafts: np.ndarray | None = None, shift: bool = False) -> None:
        """Schedule `n` tokens of `req`, then `num_drafts` draft slots (`drafts`: their host
        tokens; None: the GPU drafts them).  `num_computed` counts the `n` only: the drafts'
        KV slots are reserved, and become computed tokens only once accepted (`update`).
        `shift`: the GPU moves the row by what its previous step accepted past one token."""
        start = req.num_computed
        carry = -1
        if start >= req.num_tokens:  # its input is the token batch N-1 is still drawing
            assert n == 1 and req.last_sample[0] == b.batch_id - 1, "carry-over from a non-adjacent batch"
            carry = req.last_sample[1]
        if self.sliding_window:
            self._free_behind_window(req, start)
        if req.params.prompt_logprobs is not None:
            self._add_prompt_logprobs(b, req, start, n)
        b.requests.append(req)
        b.start.append(start)
        b.num_new.append(n + num_drafts)
        b.carry.append(carry)
        if b.shift is not None:
            b.shift.append(carry if shift else -1)
            self.speculative.verifying.discard(req)
            if num_drafts:
                self.speculative.verifying.add(req)
        req.num_computed = start + n
        self._register_blocks(req)
        if req.num_computed == req.num_tokens_with_pending:
            b.sample_seq.append(len(b.requests) - 1)
            b.token_index.append(req.num_scheduled_outputs)
            req.last_sample = (b.batch_id, len(b.sampled))
            b.sampled.append(req)
            req.num_pending += 1
            if b.drafts is not None:
                b.drafts.append(num_drafts if drafts is None else drafts)

    def _free_behind_window(self, req: Request, start: int) -> None:
        """Free the blocks below the oldest key of the query at `start` (this step's first;
        every later query sees less); their slots in the block table stay, never read."""
        dead = max(start + 1 - self.sliding_window, 0) // self.block_size
        if dead > req.num_freed_blocks:
            self.pool.free(req.block_ids[req.num_freed_blocks:dead])
            req.num_freed_blocks = dead

    @staticmethod
    def _add_prompt_logprobs(b: _BatchBuilder, req: Request, start: int, n: int) -> None:
        """Positions of this chunk whose logits score a prompt token not scored yet (a
        recompute after preemption covers positions already reported)."""
        first = max(start, len(req.prompt_logprobs))
        end = min(start + n, len(req.prompt_token_ids) - 1)
        if end > first:
            b.prompt_logprobs.append((len(b.requests), first, end - first, req.params.prompt_logprobs))

    def _register_blocks(self, req: Request) -> None:
        """Publish full blocks whose tokens are known and whose KV is scheduled."""
        full = min(req.num_computed, req.num_tokens) // self.block_size
        if full > len(req.block_keys) and self.pool.enable_prefix_caching:
            keys = self.pool.block_keys(self.table.token_ids[req.row], full, req.block_keys)
            for j in range(max(len(req.block_keys), req.num_freed_blocks), full):
                self.pool.register(req.block_ids[j], keys[j])
            req.block_keys = keys

    def _finalize(self, b: _BatchBuilder) -> ScheduledBatch:
        self.next_batch_id += 1
        start = np.array(b.start, np.int32)
        num_new = np.array(b.num_new, np.int32)
        batch = ScheduledBatch(
            batch_id=b.batch_id, requests=b.requests,
            rows=np.array([r.row for r in b.requests], np.int32), start=start, num_new=num_new,
            carry_src=np.array(b.carry, np.int32), sample_seq=np.array(b.sample_seq, np.int32),
            token_index=np.array(b.token_index, np.int32), sampled=b.sampled, table=self.table,
            max_seq_len=int((start + num_new).max()))
        for j, req in enumerate(b.sampled):
            p = req.params
            if p.logprobs is not None:
                batch.num_logprobs = max(batch.num_logprobs, p.logprobs, 1)
            if req.matcher is not None:
                batch.num_constrained += 1
            if b.token_index[j] < p.min_tokens:
                stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids))
                if stop_ids:
                    batch.suppress.append((j, sorted(stop_ids)))
        batch.penalty_resets = b.penalty_resets
        batch.prompt_logprobs = b.prompt_logprobs
        if b.drafts is not None:
            batch.spec = self.speculative.batch(b.drafts, b.shift, b.requests)
            if batch.spec is not None and batch.spec.shift_src is not None:
                batch.max_seq_len = min(batch.max_seq_len + batch.spec.k, self.table.token_ids.shape[1])
        elif self.speculative is not None and self.speculative.device:
            self.speculative.unsynced(b.requests)  # (this step writes no device history)
        if self.pool.debug:
            batch.blocks = frozenset(x for r in b.requests for x in r.block_ids[r.num_freed_blocks:])
        return batch

    # -- results ----------------------------------------------------------------------
    def update(self, batch: ScheduledBatch, result: BatchResult) -> list[Request]:
        """Take a completed batch's tokens; returns the requests that got a token or ended."""
        touched = []
        if result.prompt_logprobs:
            touched += self._take_prompt_logprobs(batch, result)
        tokens = result.tokens.tolist()
        spec = batch.spec
        for j, req in enumerate(batch.sampled):
            req.num_pending -= 1
            if spec is not None and spec.num_drafts[j]:
                self._take_verified(req, spec, result, j)
                touched.append(req)
                continue
            if req.finished:  # ended while this batch was in flight: drop the token
                continue
            self._append_token(req, tokens[j], result, j)
            touched.append(req)
        return touched

    def _append_token(self, req: Request, token: int, result: BatchResult, j: int, i: int | None = None) -> bool:
        """Append one output token, then end the request if it stops it; True if it ended
        (a plain row's one token, a drafting row's tokens one by one)."""
        req.output_token_ids.append(token)
        if req.row >= 0:
            self.table.token_ids[req.row, req.num_tokens - 1] = token
        if result.logprobs is not None and req.params.logprobs is not None:
            self._append_logprobs(req, token, result, j, i)
        reason = self._stop_reason(req, token)
        if req.matcher is not None:
            reason = self._grammar_reason(req, token, reason)
        if reason is not None:
            if reason == "stop":
                req.stop_token = token
            self.finish(req, reason, req.error)
            return True
        return False

    @staticmethod
    def _grammar_reason(req: Request, token: int, reason: str | None) -> str | None:
        """Advance the request's matcher past `token`: a terminated grammar (it accepted a stop
        token, even under ignore_eos) ends the request with "stop"; a token the grammar rejects
        (none should come: the bitmask forbids them) with "error"."""
        if not req.matcher.accept(token):
            if reason == "stop":  # a stop_token_ids entry
                return reason
            req.error = f"the sampled token {token} does not follow the request's grammar"
            return "error"
        return "stop" if req.matcher.is_terminated else reason

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        num_out = len(req.output_token_ids)
        if num_out > p.min_tokens or p.min_tokens == 0:
            if token in p.stop_token_ids or (not p.ignore_eos and token in req.eos_token_ids):
                return "stop"
        if num_out >= p.max_tokens:
            return "length"
        return None

    @staticmethod
    def _take_prompt_logprobs(batch: ScheduledBatch, result: BatchResult) -> list[Request]:
        touched = []
        for (j, first, count, k), (lps, ids) in zip(batch.prompt_logprobs, result.prompt_logprobs):
            req = batch.requests[j]
            if req.finished or first != len(req.prompt_logprobs):
                continue
            targets = req.prompt_token_ids[first + 1:first + 1 + count]
            for t, lp_row, id_row in zip(targets, lps.tolist(), ids.tolist()):
                req.prompt_logprobs.append(_logprob_entry(t, lp_row, id_row, k))
            touched.append(req)
        return touched

    @staticmethod
    def _append_logprobs(req: Request, token: int, result: BatchResult, j: int, i: int | None = None) -> None:
        """Sampling row j's logprobs (of its emitted token i, for a drafting row)."""
        k = req.params.logprobs
        lps, ids = ((result.logprobs[j], result.logprob_ids[j]) if i is None else
                    (result.spec_logprobs[j, i], result.spec_logprob_ids[j, i]))
        entry = _logprob_entry(token, lps[:1 + k].tolist(), ids[:k].tolist(), k)
        if req.logprobs is None:
            req.logprobs = []
        req.logprobs.append(entry)


def _logprob_entry(token: int, lps: list[float], top_ids: list[int], k: int) -> dict[int, float]:
    """{token: its logprob, then the top k ids in rank order: theirs}; `lps` holds the
    token's logprob first, then the top k's."""
    entry = {token: float(lps[0])}
    for t, lp in zip(top_ids[:k], lps[1:1 + k]):
        entry.setdefault(t, lp)
    return entry
