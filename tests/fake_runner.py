"""A model-free runner for scheduler tests.

It builds its inputs with the engine's own `fill_inputs`, keeps a "KV cache" of token
ids written through the slot mapping, resolves carry-over from the previous batch's
draws, and draws each token as a hash of the context it reads back through the block
table.  So a wrong block table, a block freed too early, a lost carry-over or a wrong
placeholder changes the output.  Like the GPU it executes a batch late (at `wait`).
With a `window` (a model whose every layer is windowed) it reads a row's last `window`
positions only, as the kernels do, and counts the positions before them as unknown:
blocks behind the window may have been freed and reused.
"""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import numpy as np

from slipstream.runner.inputs import fill_inputs
from slipstream.sampling.columns import ALL_COLUMNS
from slipstream.sched.batch import BatchResult

VOCAB = 97


def next_token(context: np.ndarray, seed: int, token_index: int) -> int:
    h = seed * 1000003 + token_index * 7919
    for t in context[-24:].tolist():  # a window keeps it fast; long enough to see errors
        h = (h * 31 + t + 1) % 2_147_483_647
    return int(h % VOCAB) + len(context) % 3  # stays below VOCAB + 2


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, max_seqs: int, max_tokens: int,
                 max_blocks: int, check_pool=None, window: int | None = None) -> None:
        self.block_size = block_size
        self.kv = np.full(num_blocks * block_size, -1, np.int64)
        self.prev_tokens = np.zeros(max_seqs, np.int64)
        self.pending: deque = deque()
        self.check_pool = check_pool
        self.window = window
        self.mixed_decode_rows = 0  # single-token rows of mixed batches seen (tests read it)
        T, S = max_tokens, max_seqs
        i32 = lambda n: np.zeros(n, np.int32)
        self.host = SimpleNamespace(
            input_ids=i32(T), positions=i32(T), slot_mapping=i32(T), carry_idx=i32(T),
            query_start_loc=i32(S + 1), seq_lens=i32(S), decode_order=i32(S), logits_indices=i32(S),
            token_index=i32(S), state_row=i32(S), block_table=np.zeros((S, max_blocks), np.int32),
            **{c.name: np.zeros(S, c.dtype) for c in ALL_COLUMNS})

    def launch(self, batch):
        shape = fill_inputs(batch, self.host, self.block_size, None, 0)
        h = self.host
        snapshot = {k: v.copy() for k, v in vars(h).items()}  # the "H2D copy"
        self.pending.append((batch, shape, snapshot))
        return SimpleNamespace(batch=batch)

    def wait(self, launched) -> BatchResult:
        batch, shape, h = self.pending.popleft()
        assert batch is launched.batch, "batches must complete in launch order"
        T, S = shape.num_tokens, shape.num_samples
        if shape.max_query_len == 1:  # decode rows go to the attention kernel longest first
            lens, order = h["seq_lens"][:shape.num_seqs], h["decode_order"][:shape.num_seqs]
            assert sorted(order) == list(range(shape.num_seqs)) and (np.diff(lens[order]) <= 0).all()
        else:  # a mixed batch: its single-token rows, longest first, go to the decode kernel
            qsl = h["query_start_loc"][:shape.num_seqs + 1]
            single = np.flatnonzero(np.diff(qsl) == 1)
            order = h["decode_order"][:shape.num_decode]
            assert shape.num_decode == len(single) and sorted(order) == list(single)
            assert (np.diff(h["seq_lens"][order]) <= 0).all()
            self.mixed_decode_rows += shape.num_decode
        ids = h["input_ids"][:T].astype(np.int64)
        carry = h["carry_idx"][:T]
        ids[carry >= 0] = self.prev_tokens[carry[carry >= 0]]
        slots = h["slot_mapping"][:T]
        self.kv[slots[slots >= 0]] = ids[slots >= 0]
        tokens = np.zeros(S, np.int32)
        bs = self.block_size
        for j in range(S):
            i = int(batch.sample_seq[j])
            seq_len = int(h["seq_lens"][i])
            first = max(seq_len - self.window, 0) if self.window else 0
            pos = np.arange(first, seq_len)
            ctx = self.kv[h["block_table"][i, pos // bs] * bs + pos % bs]
            assert (ctx >= 0).all(), "read a KV slot nothing wrote"
            if self.check_pool is not None:  # every block it reads is still held by a request
                held = [self.check_pool.ref_count[b] > 0 for b in h["block_table"][i, np.unique(pos // bs)]]
                assert all(held), "read a block that went back to the pool"
            ctx = np.concatenate([np.zeros(first, np.int64), ctx])  # (next_token reads the last 24)
            tokens[j] = next_token(ctx, int(h["seed"][j]), int(h["token_index"][j]))
        self.prev_tokens[:S] = tokens
        return BatchResult(tokens=tokens)


def reference_output(prompt: list[int], seed: int, max_tokens: int, stop_ids=(), min_tokens=0) -> list[int]:
    """What a request must produce, computed directly."""
    ctx = list(prompt)
    out = []
    while len(out) < max_tokens:
        t = next_token(np.array(ctx), seed, len(out))
        out.append(t)
        ctx.append(t)
        if t in stop_ids and len(out) > min_tokens:
            break
    return out
