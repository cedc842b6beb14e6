"""The `draft_model` drafter: a second, smaller model of the target's vocabulary drafts k
tokens a row on the device at the end of every step, all drafting rows batched (one draft
forward per draft position), with a KV cache of its own.  The buffers, the private
row-contiguous KV cache and the draft loop are runner/device_drafter.py's, shared with
EAGLE-3; this file runs the model:

1. extend: the draft model runs over every token of the step, as the target did (the same
   input ids at the same positions: prefill chunks, a verifying row's last token and its
   drafts), writing its KV.  A verifying row's entries past its accepted tokens hold
   rejected drafts: they are rewritten (by step 2 now, by the next step's extend later)
   before any query reads them.
2. draft: each sampling row feeds the last token it emitted at its position, which gives
   the draft model's distribution for draft 0; each draft is fed back the same way.

Catch-up: the draft needs only token ids, so the positions a row's step skips that its KV
never saw (a prefix-cache hit, steps run with speculation off) are run first, from the
host's tokens (`upload_catch_up`; per request, how far its KV reaches, in the host's
layout).  A request that leaves the running set is forgotten and starts from 0.

Greedy rows draft the draft model's argmax; sampled rows draw from q = softmax(draft logits
/ temperature) with the drafter's own noise, and q goes to rejection sampling, so the emitted
tokens follow the target whatever the draft model is.  Loaded like any model: safetensors,
GGUF, or dummy weights from a config.json path.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slipstream.model.loader import load_model
from slipstream.runner.device_drafter import DeviceDrafter, DraftStepInputs
from slipstream.runner.kv_memory import KVCacheSpec, allocate_kv_caches
from slipstream.runner.spec_device import to_device


@dataclass
class CatchUp:
    """Known tokens the draft's KV misses, one chunk a row, on the device."""
    ids: torch.Tensor  # int32 [N]
    positions: torch.Tensor  # int32 [N]
    qsl: torch.Tensor  # int32 [R + 1]
    seq_lens: torch.Tensor  # int32 [R]: each chunk's end
    rows: torch.Tensor  # int64 [R]: request-table rows
    token_rows: torch.Tensor  # int64 [N]
    max_query_len: int
    max_seq_len: int

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.ids, self.positions, self.qsl, self.seq_lens, self.rows, self.token_rows)


class DraftModelDrafter(DeviceDrafter):
    """Loads the draft model and drafts for every sampling row of each step (module doc)."""

    def __init__(self, source: str, target_vocab_size: int, num_rows: int, max_model_len: int,
                 block_size: int, device: torch.device, dtype: torch.dtype, k: int) -> None:
        fmt = "dummy" if str(source).endswith(".json") else "auto"
        self.model, self.config = load_model(source, fmt, dtype, device)
        if self.config.vocab_size != target_vocab_size:
            raise ValueError(f"speculative_config.model has vocab_size {self.config.vocab_size}, the target "
                             f"{target_vocab_size}; a draft model needs the target's vocabulary")
        super().__init__(num_rows, max_model_len, block_size, device, k, target_vocab_size)
        heads = getattr(self.model, "num_local_kv_heads", self.config.num_kv_heads)
        spec = KVCacheSpec(self.config.num_layers, block_size, heads, self.config.head_dim,
                           next(self.model.parameters()).dtype)
        self.kv_caches = allocate_kv_caches(spec, self.num_blocks, device)
        self.seen: dict[object, int] = {}  # request -> positions from 0 its KV holds (host layout)

    def forget(self, req) -> None:
        self.seen.pop(req, None)

    def upload_catch_up(self, batch, device: torch.device) -> CatchUp | None:
        chunks = []
        for b, req in enumerate(batch.requests):
            start, seen = int(batch.start[b]), self.seen.get(req, 0)
            if seen < start:
                chunks.append((int(batch.rows[b]), seen, start))
            self.seen[req] = max(seen, start + int(batch.num_new[b]))
        if not chunks:
            return None
        lens = np.array([e - s for _, s, e in chunks], np.int64)
        ids = np.concatenate([batch.table.token_ids[r, s:e] for r, s, e in chunks]).astype(np.int32)
        pos = np.concatenate([np.arange(s, e) for _, s, e in chunks]).astype(np.int32)
        rows = np.array([r for r, _, _ in chunks], np.int64)
        qsl = np.zeros(len(chunks) + 1, np.int32)
        np.cumsum(lens, out=qsl[1:])
        ends = np.array([e for _, _, e in chunks], np.int32)
        return CatchUp(to_device(ids, device), to_device(pos, device), to_device(qsl, device), to_device(ends, device),
                       to_device(rows, device), to_device(np.repeat(rows, lens), device), int(lens.max()), int(ends.max()))

    def run_catch_up(self, catch_up: CatchUp) -> None:
        c = catch_up  # (its KV only)
        self.model(c.ids, c.positions, self.meta(c.qsl, c.seq_lens, c.rows, c.positions, c.token_rows,
                                                 c.max_query_len, c.max_seq_len), self.kv_caches)

    def extend(self, slot, shape, out, num_emitted, inp: DraftStepInputs, aux, src):
        d = slot.dev
        T, B, S = shape.num_tokens, shape.num_seqs, shape.num_samples
        positions = d.positions[:T]
        meta = self.meta(d.query_start_loc[:B + 1], d.seq_lens[:B], inp.seq_rows, positions, inp.token_rows,
                         shape.max_query_len, shape.max_seq_len)
        self.model(d.input_ids[:T], positions, meta, self.kv_caches)  # (its KV only)
        last = out.long().gather(1, (num_emitted[:S].long() - 1)[:, None]).squeeze(1)
        p = positions.index_select(0, src) + 1  # the last emitted token's position (int32)
        rows = d.state_row[:S].long()
        qsl = torch.arange(S + 1, dtype=torch.int32, device=self.device)
        return self.feed(last, p, None, self.meta(qsl, p + 1, rows, p, rows, 1, shape.max_seq_len + self.k + 1))

    def feed(self, tokens, positions, state, meta):
        hidden = self.model(tokens.to(torch.int32), positions, meta, self.kv_caches)
        return self.model.compute_logits(hidden), None
