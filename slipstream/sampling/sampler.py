"""Sampling: one semantics, two implementations (pure torch, and Triton for the GPU).

`sample(logits, t, flags, state)` draws one token per row of float32 logits [B, V].
`sample_ref` is the pure-torch path (CPU engine, oracle); the Triton path
(`slipstream.ops.triton_sampling`) gives the same tokens on the same inputs and runs
without a host sync, so it can be captured in a CUDA graph. `sample` picks Triton for
CUDA tensors; `use_triton=True` forces it (on CPU it runs under TRITON_INTERPRET=1).

Semantics, per row (B rows may include padding rows; they are sampled like any other):

0. Token bitmask (structured outputs, when `t.bitmask` is given): a token the row's mask
   disallows gets logit -inf before anything else, so it is never drawn and everything
   below (logprobs included, as vLLM) sees the constrained distribution.
1. Logprobs (when flags.num_logprobs > 0) are those of the model distribution (masked):
   log_softmax of the logits as given, before penalties and temperature. Returned:
   the sampled token's logprob, then the top num_logprobs logprobs and their ids.
2. Penalties (when flags.use_penalties; rows with neutral values are unchanged):
   - repetition p, for tokens in the prompt or already generated (PenaltyState row
     `state_row`): logit > 0 -> logit / p, else logit * p;
   - then logit -= frequency * count + presence * (count > 0), count = times the
     token was generated so far.
3. Greedy rows (temperature < 1e-5, i.e. 0; padding rows use 0): the first index of
   the maximum penalised logit.
4. Sampling rows: scaled = logits * inv_t with inv_t = float32(1 / temperature)
   (a reciprocal then a product, both IEEE float32, so every implementation rounds
   alike). A token is kept iff scaled >= cutoff, where cutoff is the largest of:
   - top-k (top_k > 0): the k-th largest scaled value (ties with it are kept);
   - top-p (top_p < 1): sort the top-k-kept values descending, softmax over them,
     keep a token while the probability mass before it is < top_p (at least one);
     cutoff = the smallest kept value (ties with it are kept);
   - min-p (min_p > 0): max(scaled) + log(min_p);
   and never above max(scaled) (the most likely token is always kept).
   Then the token is argmax over kept v of scaled[v] + G(seed, token_index, v)
   (Gumbel-max: an exact draw from softmax(scaled) restricted to the kept set; first
   index on ties).
5. Noise G: pure 32-bit integer hashing, so every implementation gets the same bits:
       mix(x): x ^= x >> 16; x *= 0x21F0AAAD; x ^= x >> 15; x *= 0x735A2D97; x ^= x >> 15
       (all mod 2**32); seed_lo/seed_hi = low/high 32 bits of the int64 seed;
       k1 = mix(mix(mix(seed_lo ^ 0x2545F491) ^ seed_hi) ^ token_index)
       k2 = mix(k1 ^ 0x68E31DA4);   h = mix(mix(v ^ k1) ^ k2)
       m = h >> 8 (24 bits);  u = (m + 0.5) / 2**24;  w = 1 - u = (2**24 - 1 - m + 0.5) / 2**24
       E = -log(u)   (E = w(1 + w(1/2 + w(1/3 + w(1/4 + w/5)))) when w < 1/64, no cancellation)
       G = -log(E)   (so -2.86 < G < 17.4)
   A request's draws therefore depend only on (seed, token_index, v): never on the
   batch, the row position or the padding.

Exactness: the integer bits are identical everywhere. Float results use the same
operations in the same order; torch and Triton on the same device agree up to the ulp
of `log` (so tokens can only differ on a near-exact tie); on the GPU, Triton may also
fuse multiply-adds. Sync and async runs both use the GPU path, so they agree exactly.

Costs: the GPU path is the Triton kernel plus a few [B] torch ops; penalties, top-k /
top-p (a sort of [B, V]) and logprobs (log_softmax + topk) add torch ops only when the
flags ask for them. min-p needs only the row maximum (computed in the kernel).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from slipstream.sampling.grammar.bitmask import apply_bitmask_ref
from slipstream.sampling.noise import bits, gumbel_from_bits, gumbel_noise_ref, random_bits_ref, row_keys

__all__ = [
    "SamplingTensors",
    "SamplerFlags",
    "PenaltyState",
    "SamplerOutput",
    "sample",
    "sample_ref",
    "sample_triton",
    "apply_penalties",
    "masked_logits",
    "processed_logits",
    "random_bits_ref",
    "gumbel_noise_ref",
    "GREEDY_EPS",
]

#: temperatures below this are greedy (SamplingParams' GREEDY_TEMPERATURE_EPS; the Triton
#: kernel has the same literal)
GREEDY_EPS = 1e-5

#: a token whose scaled value s has s + _SKIP < max(scaled) - 3 cannot win (see _candidates)
_SKIP = 32.0


@dataclass
class SamplingTensors:
    """Per-row sampling parameters, one row per logits row, on the logits' device."""
    temperature: torch.Tensor         # float32 [B]; 0 = greedy
    top_k: torch.Tensor               # int32 [B]; 0 = off
    top_p: torch.Tensor               # float32 [B]; 1.0 = off
    min_p: torch.Tensor               # float32 [B]; 0.0 = off
    seed: torch.Tensor                # int64 [B]
    token_index: torch.Tensor         # int32 [B]; index of the output token being drawn
    repetition_penalty: torch.Tensor  # float32 [B]; 1.0 = off
    presence_penalty: torch.Tensor    # float32 [B]; 0.0 = off
    frequency_penalty: torch.Tensor   # float32 [B]; 0.0 = off
    state_row: torch.Tensor           # int32 [B]; row of the request in PenaltyState
    # optional, precomputed on the host (the runner) to save device launches; else derived:
    inv_t: torch.Tensor | None = None      # float32 [B]: float32(1 / temperature), 1 for greedy
    log_min_p: torch.Tensor | None = None  # float32 [B]: log(min_p), -inf = off
    # int32 [B, ceil(V / 32)] token bitmask of structured outputs (sampling/grammar/bitmask.py):
    # a token whose bit is clear, or past the mask, is never drawn; None = all allowed
    bitmask: torch.Tensor | None = None

    @classmethod
    def from_lists(cls, temperature: Sequence[float], *, top_k=None, top_p=None, min_p=None,
                   seed=None, token_index=None, repetition_penalty=None, presence_penalty=None,
                   frequency_penalty=None, state_row=None, device=None) -> "SamplingTensors":
        """Build from per-row Python values (eager; tests, the CPU engine). Unset = off."""
        n = len(temperature)

        def col(values, default, dtype):
            if values is None:
                values = [default] * n
            if len(values) != n:
                raise ValueError(f"expected {n} values, got {len(values)}")
            return torch.tensor(list(values), dtype=dtype, device=device)

        return cls(
            temperature=col(temperature, 0.0, torch.float32),
            top_k=col(top_k, 0, torch.int32),
            top_p=col(top_p, 1.0, torch.float32),
            min_p=col(min_p, 0.0, torch.float32),
            seed=col(seed, 0, torch.int64),
            token_index=col(token_index, 0, torch.int32),
            repetition_penalty=col(repetition_penalty, 1.0, torch.float32),
            presence_penalty=col(presence_penalty, 0.0, torch.float32),
            frequency_penalty=col(frequency_penalty, 0.0, torch.float32),
            state_row=col(state_row, 0, torch.int32),
        )


@dataclass(frozen=True)
class SamplerFlags:
    """Host-side switches decided by the CPU from the batch's SamplingParams."""
    use_top_k_top_p: bool  # any sampling row has top_k or top_p on (needs a sort)
    use_penalties: bool    # any row has a penalty on
    num_logprobs: int      # 0 = no logprobs; else top-k logprobs to return (<= 20)


@dataclass
class SamplerOutput:
    tokens: torch.Tensor                          # int32 [B]
    logprobs: torch.Tensor | None = None          # float32 [B, 1 + num_logprobs]
    logprob_token_ids: torch.Tensor | None = None  # int32 [B, num_logprobs]

    @property
    def logprob_ids(self) -> torch.Tensor | None:  # alias used by the runner
        return self.logprob_token_ids


class PenaltyState:
    """Per-request penalty state on the device; rows are reused across requests.

    All `num_rows` rows are usable; callers reserve one of them as the scratch row that
    padding rows point at (its contents are meaningless).
    """

    def __init__(self, num_rows: int, vocab_size: int, device=None) -> None:
        self.num_rows = num_rows
        self.vocab_size = vocab_size
        self.prompt_mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=device)

    @property
    def device(self) -> torch.device:
        return self.output_counts.device

    def reset_row(self, row: int, prompt_token_ids, output_token_ids=()) -> None:
        """(Re)initialise a request's row from its token ids (eager; lists or tensors)."""
        self.prompt_mask[row].zero_()
        self.output_counts[row].zero_()
        prompt = torch.as_tensor(prompt_token_ids, dtype=torch.long).reshape(-1).to(self.device)
        if prompt.numel():
            self.prompt_mask[row].index_fill_(0, prompt, True)
        outputs = torch.as_tensor(output_token_ids, dtype=torch.long).reshape(-1).to(self.device)
        if outputs.numel():
            self.output_counts[row].scatter_add_(
                0, outputs, torch.ones(outputs.shape, dtype=torch.int32, device=self.device))

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """output_counts[rows[i], tokens[i]] += 1 for every i (repeats accumulate).

        Capturable (no host sync). Tokens must be valid ids in [0, vocab_size)."""
        flat = rows.long() * self.vocab_size + tokens.long()
        self.output_counts.view(-1).scatter_add_(
            0, flat, torch.ones(flat.shape, dtype=torch.int32, device=flat.device))


# ----------------------------------------------------------------------------- shared torch parts


def apply_penalties(logits: torch.Tensor, t: SamplingTensors, state: PenaltyState) -> torch.Tensor:
    """Repetition (prompt + output), then frequency and presence (output); a new tensor."""
    rows = t.state_row.long()
    counts = state.output_counts.index_select(0, rows)
    generated = counts > 0
    seen = state.prompt_mask.index_select(0, rows) | generated
    rp = t.repetition_penalty.float()[:, None]
    penalised = torch.where(logits > 0, logits / rp, logits * rp)
    logits = torch.where(seen, penalised, logits)
    adjust = (t.frequency_penalty.float()[:, None] * counts.float()
              + t.presence_penalty.float()[:, None] * generated.float())
    return logits - adjust


def _row_scalars(t: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperature, inv_t, log_min_p) as float32 [B]; inv_t = 1 for greedy rows."""
    temp = t.temperature.float()
    inv_t = t.inv_t
    if inv_t is None:
        inv_t = torch.where(temp < GREEDY_EPS, torch.ones_like(temp), temp).reciprocal()
    log_min_p = t.log_min_p
    if log_min_p is None:
        log_min_p = torch.log(t.min_p.float())  # log(0) = -inf: off
    return temp, inv_t, log_min_p


def _top_k_top_p_cutoff(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """float32 [B]: the smallest scaled value kept by top-k then top-p (an element of the row)."""
    B, V = scaled.shape
    sorted_vals = scaled.sort(dim=-1, descending=True).values
    k = top_k.long()
    k = torch.where((k <= 0) | (k > V), torch.full_like(k, V), k)
    ranks = torch.arange(V, device=scaled.device)
    in_k = ranks[None, :] < k[:, None]
    probs = torch.softmax(sorted_vals.masked_fill(~in_k, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    n_p = (mass_before < top_p.float()[:, None]).sum(dim=-1)
    n = torch.where(top_p.float() >= 1.0, k, torch.minimum(n_p.clamp(min=1), k))
    return sorted_vals.gather(1, (n - 1)[:, None]).squeeze(1)


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    lp = torch.log_softmax(raw, dim=-1)
    sampled = lp.gather(1, tokens.long()[:, None])
    top_vals, top_ids = lp.topk(n, dim=-1)
    return torch.cat([sampled, top_vals], dim=1), top_ids.to(torch.int32)


def _check(logits: torch.Tensor, flags: SamplerFlags) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    if flags.num_logprobs < 0 or flags.num_logprobs > logits.shape[1]:
        raise ValueError(f"num_logprobs must be in [0, vocab], got {flags.num_logprobs}")


def masked_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """float32 copy of `logits` with the tokens `bitmask` disallows at -inf (graph-safe)."""
    return apply_bitmask_ref(logits.float().clone(), bitmask)


def _prepare(logits: torch.Tensor, t: SamplingTensors, flags: SamplerFlags,
             state: PenaltyState | None) -> tuple[torch.Tensor, torch.Tensor]:
    _check(logits, flags)
    raw = logits.float() if t.bitmask is None else masked_logits(logits, t.bitmask)
    if flags.use_penalties:
        if state is None:
            raise ValueError("flags.use_penalties needs a PenaltyState")
        return raw, apply_penalties(raw, t, state)
    return raw, raw


def processed_logits(logits: torch.Tensor, t: SamplingTensors, flags: SamplerFlags,
                     state: PenaltyState | None = None) -> torch.Tensor:
    """float32 [B, V]: the distribution step 4 draws from, as logits (softmax gives it):
    the (masked, penalised) logits scaled by inv_t, the tokens below the row's top-k /
    top-p / min-p cutoff at -inf.  Greedy rows keep their penalised logits (inv_t = 1, no
    cutoff): their argmax is the token step 3 picks.  Speculative decoding verifies drafts
    against it (rejection sampling needs the probabilities, not one draw)."""
    _, logits = _prepare(logits, t, flags, state)
    temp, inv_t, log_min_p = _row_scalars(t)
    greedy = temp < GREEDY_EPS
    scaled = logits * inv_t[:, None]
    smax = scaled.amax(dim=-1)
    cutoff = smax + log_min_p
    if flags.use_top_k_top_p:
        cutoff = torch.maximum(cutoff, _top_k_top_p_cutoff(scaled, t.top_k, t.top_p))
    cutoff = torch.where(greedy, torch.full_like(smax, float("-inf")), torch.minimum(cutoff, smax))
    return scaled.masked_fill(scaled < cutoff[:, None], float("-inf"))


def _finish(raw: torch.Tensor, tokens: torch.Tensor, flags: SamplerFlags,
            out: torch.Tensor | None = None) -> SamplerOutput:
    if out is not None and tokens is not out:
        tokens = out.copy_(tokens)
    if flags.num_logprobs > 0:
        logprobs, ids = _logprobs(raw, tokens, flags.num_logprobs)
        return SamplerOutput(tokens, logprobs, ids)
    return SamplerOutput(tokens)


# ----------------------------------------------------------------------------- the two paths


def sample_ref(logits: torch.Tensor, t: SamplingTensors, flags: SamplerFlags,
               state: PenaltyState | None = None, out: torch.Tensor | None = None) -> SamplerOutput:
    """Pure-torch sampler (the CPU path and the oracle).

    Noise is computed only for candidate tokens (those that could still win given the
    bounds of G), which keeps the CPU path cheap on peaked distributions; the result
    is the same as with noise on every kept token. This path may sync the host.
    """
    raw, logits = _prepare(logits, t, flags, state)
    B, V = logits.shape
    temp, inv_t, log_min_p = _row_scalars(t)
    greedy = temp < GREEDY_EPS
    scaled = logits * inv_t[:, None]
    smax = scaled.amax(dim=-1) if V else torch.full((B,), float("-inf"), device=logits.device)
    cutoff = smax + log_min_p
    if flags.use_top_k_top_p:
        cutoff = torch.maximum(cutoff, _top_k_top_p_cutoff(scaled, t.top_k, t.top_p))
    cutoff = torch.minimum(cutoff, smax)
    keep = scaled >= cutoff[:, None]
    # G < G_MAX and G > G_MIN, so fl(s + G) <= fl(s + _SKIP) < fl(smax - 3) <= the value of
    # the argmax of scaled: tokens failing this test can neither win nor tie.
    cand = keep & ~greedy[:, None] & ((scaled + _SKIP) >= (smax - 3.0)[:, None])
    rows, cols = cand.nonzero(as_tuple=True)
    k1, k2 = row_keys(t.seed, t.token_index)
    g = gumbel_from_bits(bits(cols, k1[rows], k2[rows]))
    vals = torch.full_like(scaled, float("-inf"))
    vals[rows, cols] = scaled[rows, cols] + g
    if V:
        sampled = vals.argmax(dim=-1)
        greedy_tok = logits.argmax(dim=-1)
        tokens = torch.where(greedy, greedy_tok, sampled).to(torch.int32)
    else:
        tokens = torch.zeros(B, dtype=torch.int32, device=logits.device)
    return _finish(raw, tokens, flags, out)


def sample_triton(logits: torch.Tensor, t: SamplingTensors, flags: SamplerFlags,
                  state: PenaltyState | None = None, *, num_splits: int | None = None,
                  block_v: int | None = None, out: torch.Tensor | None = None) -> SamplerOutput:
    """GPU path: torch ops for penalties / top-k / top-p / logprobs, then the Triton
    kernel for temperature, cutoff, noise and argmax. No host sync (capturable)."""
    from slipstream.ops.triton_sampling import sample_tokens_triton

    if flags.use_penalties or flags.use_top_k_top_p or flags.num_logprobs:
        raw, logits = _prepare(logits, t, flags, state)  # (masked here too, for the sort and logprobs)
    else:  # the kernel reads the logits in their own dtype: no float32 copy of [B, V]
        _check(logits, flags)
        raw = logits
    temp, inv_t, log_min_p = _row_scalars(t)
    cutoff = None
    if flags.use_top_k_top_p:
        scaled = logits * inv_t[:, None]
        smax = scaled.amax(dim=-1)
        cutoff = torch.maximum(_top_k_top_p_cutoff(scaled, t.top_k, t.top_p), smax + log_min_p)
        cutoff = torch.minimum(cutoff, smax)
        del scaled
    # the kernel reads [B] vectors densely, with these exact dtypes (no-ops when already so)
    tokens = sample_tokens_triton(logits, temp.contiguous(), inv_t, log_min_p, cutoff,
                                  t.seed.to(torch.int64).contiguous(),
                                  t.token_index.to(torch.int32).contiguous(),
                                  bitmask=t.bitmask, num_splits=num_splits, block_v=block_v, out=out)
    return _finish(raw, tokens, flags)


def sample(logits: torch.Tensor, t: SamplingTensors, flags: SamplerFlags,
           state: PenaltyState | None = None, *, use_triton: bool | None = None,
           num_splits: int | None = None, block_v: int | None = None,
           out: torch.Tensor | None = None) -> SamplerOutput:
    """Draw one token per row. Triton on CUDA (or when use_triton=True), torch otherwise.
    `out` (int32 [B]) receives the tokens in place when given."""
    if use_triton is None:
        use_triton = logits.is_cuda
    if use_triton:
        return sample_triton(logits, t, flags, state, num_splits=num_splits, block_v=block_v, out=out)
    return sample_ref(logits, t, flags, state, out)

