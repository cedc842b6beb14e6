"""Prompt logprobs: the prompt tokens a step's prefill scores, and their scores.

A request asking for `prompt_logprobs` gets, for each prompt position its prefill chunk
computes, the logprob of the next prompt token and the top k. The runner finds those token
spans in the step (`step_prompt_spans`) and scores them from the step's hidden states
(`score_prompt_spans`); both run wherever a prefill runs (plain, speculative and drafting
steps, and a tensor-parallel driver's)."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from slipstream.sched.batch import ScheduledBatch

# (first token index in the step, count, the prompt tokens they score, top k)
PromptSpan = tuple[int, int, np.ndarray, int]

_CHUNK = 512  # [512, vocab] float32 logits at a time


def step_prompt_spans(batch: ScheduledBatch, query_start_loc: np.ndarray) -> list[PromptSpan]:
    """batch.prompt_logprobs as token spans of the step: position p of sequence row j is
    token query_start_loc[j] + p - start[j]; it scores prompt token p + 1. Empty when no
    request of the batch asks for prompt logprobs."""
    spans = []
    for j, first_pos, count, k in batch.prompt_logprobs:
        req = batch.requests[j]
        first = int(query_start_loc[j]) + first_pos - int(batch.start[j])
        targets = np.asarray(req.prompt_token_ids[first_pos + 1:first_pos + 1 + count], np.int64)
        spans.append((first, count, targets, k))
    return spans


def score_prompt_spans(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                       spans: list[PromptSpan]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each span: float32 [count, 1 + k] (the prompt token's logprob, then the top k) and
    int32 ids [count, k], on hidden's device."""
    out = []
    for first, count, targets, k in spans:
        tgt = torch.as_tensor(targets, dtype=torch.long).to(hidden.device)
        lps, ids = [], []
        for a in range(0, count, _CHUNK):
            b = min(a + _CHUNK, count)
            lp = torch.log_softmax(compute_logits(hidden[first + a:first + b]).float(), dim=-1)
            chosen = lp.gather(1, tgt[a:b, None])
            top, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
            lps.append(torch.cat([chosen, top], dim=1))
            ids.append(top_ids.to(torch.int32))
        out.append((torch.cat(lps), torch.cat(ids)))
    return out
