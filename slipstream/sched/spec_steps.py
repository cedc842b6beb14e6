"""The scheduler's speculative steps (a mixin of `Scheduler`, kept apart so that a plain
step's code reads as it did): the running rows' loop when rows draft or shift, and the
appending of a verifying row's emitted tokens.  Policy and state: sched/speculative.py."""
from __future__ import annotations

import numpy as np

from slipstream.sched.request import Request, Status
from slipstream.sched.speculative import SpecBatch


class SpeculativeSteps:
    """Needs the Scheduler's running, table, speculative, _reserve, _add and _append_token
    (`b` is its batch builder, `result` a BatchResult, sched/batch.py: sched/scheduler.py imports this)."""

    def _schedule_drafting(self, b, budget: int, allowed: bool) -> tuple[int, bool]:
        """The running requests' part of `schedule` when rows draft (the loop of a plain step,
        plus the drafts, if `allowed`, and the shifts); returns the budget left and whether a
        request stalled."""
        spec = self.speculative
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.all_done_scheduling:
                i += 1
                continue
            n = min(req.num_tokens_with_pending - req.num_computed, budget)
            drafts, m, shift = None, 0, 0
            if spec.device:  # the GPU drafts k tokens; the step before may shift the row
                shift = spec.k if req.num_pending and req in spec.verifying else 0
                m = spec.k if allowed and n == 1 and spec.may_verify(
                    req, budget - n, self.table.token_ids[req.row, :req.num_tokens]) else 0
            elif n == 1:  # drafted here, now
                drafts = self._drafts(req, budget - n)
                m = 0 if drafts is None else len(drafts)
            if not self._reserve(req, min(req.num_computed + n + m + shift, self.table.token_ids.shape[1])):
                return budget, req.status is Status.RUNNING
            if drafts is not None:  # the step's inputs past the known tokens (rewritten as tokens arrive)
                self.table.token_ids[req.row, req.num_tokens:req.num_tokens + m] = drafts
            self._add(b, req, n, m, drafts, shift > 0)
            budget -= n + m
            i += 1
        return budget, False

    def _drafts(self, req: Request, budget: int) -> np.ndarray | None:
        limit = min(self.speculative.max_drafts(req), budget)
        if limit <= 0:
            return None
        drafts = self.speculative.propose(req, self.table.token_ids[req.row, :req.num_tokens], limit)
        return drafts if len(drafts) else None

    def _take_verified(self, req: Request, spec: SpecBatch, result, j: int) -> None:
        """A drafting row's emitted tokens (the accepted drafts, then the target's own), cut at
        the first that ends the request; then its KV is trusted up to its last known token
        only: the rejected drafts' entries past it are rewritten before any query reads them."""
        emitted = int(result.num_emitted[j])
        if result.num_drafted[j]:  # (device drafting: a row may have found none)
            self.speculative.record(int(result.num_drafted[j]), emitted)
        if req.finished:
            return
        for i, token in enumerate(result.spec_tokens[j, :emitted].tolist()):
            if self._append_token(req, token, result, j, i):
                return
        if req.status is Status.RUNNING:  # (a preempted request recomputes from 0)
            # every step still in flight for it is counted as one token, as always
            req.num_computed = req.num_tokens - 1 + req.num_pending
