"""The two messages between the scheduler and the runner: the batch a step computes
(`ScheduledBatch`, host arrays) and what the runner hands back for it (`BatchResult`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slipstream.sched.request import Request
from slipstream.sched.request_table import RequestTable
from slipstream.sched.speculative import SpecBatch


@dataclass
class ScheduledBatch:
    batch_id: int
    requests: list[Request]  # one per sequence row
    rows: np.ndarray  # int32 [B] request-table rows
    start: np.ndarray  # int32 [B] first position computed this step
    num_new: np.ndarray  # int32 [B] tokens computed this step
    carry_src: np.ndarray  # int32 [B] previous batch's sample row giving this row's input, or -1
    sample_seq: np.ndarray  # int32 [S] sequence row of each sampling row
    token_index: np.ndarray  # int32 [S] output index each sampling row draws
    sampled: list[Request]  # request of each sampling row
    table: RequestTable
    max_seq_len: int
    num_logprobs: int = 0  # top-k logprobs to return (max over sampling rows)
    suppress: list[tuple[int, list[int]]] = field(default_factory=list)  # (sample row, token ids) masked for min_tokens
    penalty_resets: list[tuple[int, list[int], list[int]]] = field(default_factory=list)  # (row, prompt, outputs)
    # requests asking for prompt logprobs: (sequence row, first position, positions, top k);
    # position p's logits give the logprob of prompt token p + 1
    prompt_logprobs: list[tuple[int, int, int, int]] = field(default_factory=list)
    blocks: frozenset[int] = frozenset()  # every block it touches (debug_kv only)
    # sampling rows with structured outputs: the batch's sampling waits for their token bitmask
    num_constrained: int = 0
    # speculative decoding: the drafts its sampling rows verify (None: no row drafts)
    spec: SpecBatch | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return int(self.num_new.sum())

    @property
    def is_decode_only(self) -> bool:
        return bool((self.num_new == 1).all()) and len(self.sampled) == len(self.requests)


@dataclass
class BatchResult:
    """What the runner hands back for a batch: host arrays, one entry per sampling row."""
    tokens: np.ndarray  # int32 [S]
    logprobs: np.ndarray | None = None  # float32 [S, 1 + k]: sampled token, then top-k
    logprob_ids: np.ndarray | None = None  # int32 [S, k]
    # per ScheduledBatch.prompt_logprobs entry: (float32 [m, 1 + k] target then top-k, int32 [m, k])
    prompt_logprobs: list[tuple[np.ndarray, np.ndarray]] | None = None
    # a batch with drafts (ScheduledBatch.spec): each sampling row's emitted tokens, int32
    # [S, k + 1] (-1 past them), and their count [S]; `tokens` holds the last of them
    spec_tokens: np.ndarray | None = None
    num_emitted: np.ndarray | None = None
    num_drafted: np.ndarray | None = None  # int32 [S]: the drafts each row verified
    # logprobs of a drafting row's emitted tokens: float32 [S, k + 1, 1 + n], int32 [S, k + 1, n]
    spec_logprobs: np.ndarray | None = None
    spec_logprob_ids: np.ndarray | None = None
