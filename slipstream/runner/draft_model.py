"""The `draft_model` drafter: a second, smaller model of the target's vocabulary proposes a
row's k drafts autoregressively, with KV cache of its own.

Design (the simplest correct one): the draft's KV cache is private and row-contiguous: row r
of the request table owns the draft blocks [r * B, (r + 1) * B) (B = ceil(max_model_len /
block_size)), so the draft needs no block pool, no prefix cache and no eviction of its own;
it costs (rows x max_model_len) tokens of the draft's (small) KV.  Per request it remembers
how many of the request's known tokens its KV holds (`computed`); a proposal first runs the
draft over the known tokens past that (one causal chunk: the prompt at the first proposal),
then feeds each draft back, one token a step.  The drafts' own KV entries lie past the
known tokens and are rewritten by the next proposal (it restarts at the known tokens), so
rejected drafts are never read.  A request that leaves the running set (finished,
preempted) is forgotten and starts from 0 next time.

Drafts: greedy rows draft the draft model's argmax; sampled rows draw from
q = softmax(draft logits / temperature) with the drafter's own noise
(`spec.draft.sample_drafts`), and q goes to `rejection_sample` as draft_probs, so the
emitted tokens follow the target whatever the draft model is.

It runs in the synchronous loop: the scheduler asks it for a row's drafts while building a
batch (the row's known tokens are all on the host then), and the drafts travel as host
tokens like n-gram drafts; q stays on the device.
"""
from __future__ import annotations

import numpy as np
import torch

from slipstream.model.loader import load_model
from slipstream.ops.metadata import AttentionMetadata
from slipstream.runner.kv_memory import KVCacheSpec, allocate_kv_caches
from slipstream.spec.draft import sample_drafts


class DraftModelProposer:
    """Loads the draft model and proposes drafts for one request at a time."""

    def __init__(self, source: str, target_vocab_size: int, num_rows: int, max_model_len: int,
                 block_size: int, device: torch.device, dtype: torch.dtype, k: int) -> None:
        fmt = "dummy" if str(source).endswith(".json") else "auto"
        self.model, self.config = load_model(source, fmt, dtype, device)
        if self.config.vocab_size != target_vocab_size:
            raise ValueError(f"speculative_config.model has vocab_size {self.config.vocab_size}, the target "
                             f"{target_vocab_size}; a draft model needs the target's vocabulary")
        self.device, self.k, self.block_size = device, k, block_size
        self.blocks_per_row = -(-max_model_len // block_size)
        heads = getattr(self.model, "num_local_kv_heads", self.config.num_kv_heads)
        spec = KVCacheSpec(self.config.num_layers, block_size, heads, self.config.head_dim,
                           next(self.model.parameters()).dtype)
        self.kv_caches = allocate_kv_caches(spec, num_rows * self.blocks_per_row, device)
        self.computed: dict[object, int] = {}  # request -> its known tokens in the draft's KV

    def forget(self, req) -> None:
        self.computed.pop(req, None)

    @torch.inference_mode()
    def propose(self, req, tokens: np.ndarray, limit: int, temperature: float, seed: int,
                token_index: int) -> tuple[np.ndarray, torch.Tensor]:
        """Up to `limit` (>= 1) drafts continuing `tokens` (the request's known tokens, in
        table row `req.row`): int32 [m] on the host and q float32 [m, V] on the device."""
        L = len(tokens)
        start = min(self.computed.get(req, 0), L - 1)
        dev = self.device
        greedy = torch.tensor([temperature <= 0.0], device=dev)
        seed_t = torch.tensor([seed], dtype=torch.long, device=dev)
        ids = torch.as_tensor(np.asarray(tokens[start:L], np.int64), device=dev)
        pos = start
        drafts, probs = [], []
        for j in range(limit):
            logits = self._forward(req.row, ids, pos)[-1:].float()
            if temperature > 0.0:
                logits = logits / temperature
            tok, q = sample_drafts(logits, greedy, seed_t, torch.tensor([token_index + j], device=dev))
            drafts.append(tok)
            probs.append(q)
            pos += ids.shape[0]
            ids = tok.long()
        self.computed[req] = L
        return torch.cat(drafts).cpu().numpy().astype(np.int32), torch.cat(probs)

    def _forward(self, row: int, ids: torch.Tensor, start: int) -> torch.Tensor:
        """The draft's logits at each of `ids`, at positions start.., KV written into the row's
        blocks."""
        n, dev, bs = ids.shape[0], self.device, self.block_size
        positions = torch.arange(start, start + n, device=dev)
        table = (row * self.blocks_per_row + torch.arange(self.blocks_per_row, device=dev)).to(torch.int32)
        slots = (table.long()[positions // bs] * bs + positions % bs).to(torch.int32)
        seq_len = start + n
        meta = AttentionMetadata(torch.tensor([0, n], dtype=torch.int32, device=dev),
                                 torch.tensor([seq_len], dtype=torch.int32, device=dev), table[None, :],
                                 slots, n, seq_len)
        hidden = self.model(ids, positions, meta, self.kv_caches)
        return self.model.compute_logits(hidden)
