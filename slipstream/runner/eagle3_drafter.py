"""The `eagle3` drafter: an EAGLE-3 head (model/eagle3.py) drafts k tokens a row on the device
at the end of every step, from the target's hidden states of that step, so the next step's
drafts are already on the GPU when it starts (sync and async loops alike).  The buffers, the
head's private row-contiguous KV cache and the draft loop are runner/device_drafter.py's.

At the end of a step (after sampling and verification), on the compute stream:

1. extend: the head runs over every token of the step.  Token t at position p reads the
   target's three captured hidden states at t (`AuxHiddenCapture` around the target's eager
   forward) and the embedding of the token that follows it: the next input of its row, or,
   at a sampling row's query tokens, the tokens the row emitted (out[j] follows query token
   j; past the accepted ones this is padding, rewritten next step), or, at the end of a
   prefill chunk, the next prompt token.  Its KV goes into the head's cache at p.
2. draft: from each sampling row's last accepted query token the head drafts
   autoregressively, feeding each draft back with its own pre-norm output as the next
   hidden state (the EAGLE-3 recipe), one decode-shaped head step per draft, all rows
   batched.  q is the head's distribution mapped into the target's vocabulary (`d2t`; the
   target ids outside the draft vocabulary get 0); an all-greedy step takes the argmax over
   the draft vocabulary and maps that one id (`d2t` is increasing in the published heads, so
   ties break as over the target's ids).
"""
from __future__ import annotations

import torch

from slipstream.model.eagle3 import AuxHiddenCapture
from slipstream.model.eagle3_loader import load_eagle3
from slipstream.model.llama import rope_inv_freq
from slipstream.ops.fused import build_cos_sin_cache
from slipstream.runner.device_drafter import DeviceDrafter, DraftStepInputs
from slipstream.runner.kv_memory import KVCacheSpec, allocate_kv_caches


class Eagle3Drafter(DeviceDrafter):
    """Loads the head and drafts for every sampling row of each step (module doc)."""

    feed_offset = 1  # the head reads token t + 1 at position t

    def __init__(self, source: str, target, target_config, num_rows: int, max_model_len: int,
                 block_size: int, device: torch.device, dtype: torch.dtype, k: int) -> None:
        fmt = "dummy" if str(source).endswith(".json") else "auto"
        self.head = load_eagle3(source, fmt, dtype, device)
        c = self.head.config
        if c.vocab_size != target_config.vocab_size:
            raise ValueError(f"speculative_config.model: the EAGLE-3 head's vocab_size is {c.vocab_size}, "
                             f"the target's {target_config.vocab_size}")
        if c.target_hidden_size != target_config.hidden_size:
            raise ValueError(f"speculative_config.model: the EAGLE-3 head reads target hidden states of "
                             f"size {c.target_hidden_size}, the target's are {target_config.hidden_size}")
        if c.layer.max_position_embeddings < max_model_len + k:
            # published heads declare their training length (2048 for Llama 3.1's) and serve
            # the target's: RoPE's table only has to reach the target's positions
            inv_freq = rope_inv_freq(c.layer).to(self.head.device)
            self.head.cos_sin_cache = build_cos_sin_cache(inv_freq, max_model_len + k + 1).to(device)
        if self.head.embed_tokens is None:
            self.head.share_embedding(target.embed_tokens.weight)
        self.aux_layers = c.aux_layers(len(target.layers))
        self.target = target
        super().__init__(num_rows, max_model_len, block_size, device, k, c.vocab_size)
        lc = c.layer
        spec = KVCacheSpec(1, block_size, lc.num_kv_heads, lc.head_dim, dtype)
        self.kv_cache = allocate_kv_caches(spec, self.num_blocks, device)[0]

    def capture(self) -> AuxHiddenCapture:
        return AuxHiddenCapture(self.target, self.aux_layers)

    def extend(self, slot, shape, out, num_emitted, inp: DraftStepInputs, aux: AuxHiddenCapture, src):
        """The head over the step's tokens (module doc): token t reads the target's hidden
        states at t and the token that follows t."""
        d = slot.dev
        T, B = shape.num_tokens, shape.num_seqs
        ids = d.input_ids[:T].long()
        positions = d.positions[:T]
        nxt = torch.zeros(T + 1, dtype=torch.long, device=self.device)  # (index T: a scratch entry)
        nxt[:T - 1] = ids[1:]
        nxt[inp.prompt_at] = inp.prompt_next
        j = torch.arange(out.shape[1], device=self.device)[None, :]
        at = torch.where(j <= inp.num_slots[:, None], inp.first[:, None] + j, T)
        nxt[at.reshape(-1)] = out.long().clamp(min=0).reshape(-1)
        meta = self.meta(d.query_start_loc[:B + 1], d.seq_lens[:B], inp.seq_rows, positions, inp.token_rows,
                         shape.max_query_len, shape.max_seq_len)
        head = self.head
        normed, pre = head(nxt[:T], positions, head.combine_hidden_states(aux.aux()), meta, self.kv_cache)
        return head.compute_logits(normed.index_select(0, src)), pre.index_select(0, src)

    def feed(self, tokens, positions, state, meta):
        normed, pre = self.head(tokens, positions, state, meta, self.kv_cache)
        return self.head.compute_logits(normed), pre

    def target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.draft_to_target(ids)

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.head.spread_to_target(logits)
