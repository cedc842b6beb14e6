"""The sampler (slipstream/sampling/sampler.py): semantics of the torch path, and the Triton kernel
(slipstream/ops/triton_sampling.py, interpreter on CPU) giving the same tokens."""
import math

import numpy as np
import pytest
import torch

from slipstream.sampling.sampler import (
    PenaltyState,
    SamplerFlags,
    SamplerOutput,
    SamplingTensors,
    apply_penalties,
    gumbel_noise_ref,
    random_bits_ref,
    sample,
    sample_ref,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
OFF = SamplerFlags(False, False, 0)
TOPKP = SamplerFlags(True, False, 0)


def _logits(B, V, seed, scale=3.0):
    return (torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * scale).to(DEV)


def _tensors(B, **kw):
    kw.setdefault("temperature", [1.0] * B)
    temperature = kw.pop("temperature")
    return SamplingTensors.from_lists(temperature, device=DEV, **kw)


def _chi2_critical(df, z=4.26):
    """Wilson-Hilferty upper quantile of chi-square (z = 4.26: p ~ 1e-5)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _assert_frequencies(tokens, probs, n):
    """Chi-square goodness of fit of `n` draws `tokens` against `probs` (1-D)."""
    counts = torch.bincount(tokens.long().cpu(), minlength=probs.numel()).double()
    expected = probs.double().cpu() * n
    assert counts[expected == 0].sum() == 0, "drew a token of probability 0"
    support = expected > 0
    if int(support.sum()) == 1:
        return
    chi2 = ((counts[support] - expected[support]) ** 2 / expected[support]).sum().item()
    df = int(support.sum()) - 1
    assert chi2 < _chi2_critical(df), f"chi2 {chi2:.1f} over {df} dof: {counts.tolist()} vs {expected.tolist()}"


# ----------------------------------------------------------------------------- noise


def test_hash_bits_triton_equal_torch():
    from slipstream.ops.triton_sampling import gumbel_noise_triton, random_bits_triton
    seed = torch.tensor([0, 1, -1, 2**40 + 7, -(2**63), 2**63 - 1], dtype=torch.int64, device=DEV)
    tidx = torch.tensor([0, 9, 123456, 2**31 - 1, 1, 0], dtype=torch.int32, device=DEV)
    a = random_bits_ref(seed, tidx, 777)
    b = random_bits_triton(seed, tidx, 777)
    assert torch.equal(a, b)
    assert a.min() >= 0 and a.max() < 2**32
    ga, gb = gumbel_noise_ref(seed, tidx, 777), gumbel_noise_triton(seed, tidx, 777)
    # same bits; the float part differs at most by the ulp of log
    torch.testing.assert_close(ga, gb, atol=5e-6, rtol=1e-6)


def test_noise_statistics():
    B, V = 64, 4096
    seed = torch.arange(B, dtype=torch.int64) * 7919 - 5
    tidx = torch.arange(B, dtype=torch.int32) % 5
    h = random_bits_ref(seed, tidx, V)
    # 16 buckets of the top 4 bits: uniform
    buckets = torch.bincount((h >> 28).flatten(), minlength=16).double()
    n = h.numel()
    chi2 = ((buckets - n / 16) ** 2 / (n / 16)).sum().item()
    assert chi2 < _chi2_critical(15)
    # every bit is fair
    bits = torch.stack([(h >> i) & 1 for i in range(32)]).double().mean(dim=(1, 2))
    assert (bits - 0.5).abs().max() < 0.01
    g = gumbel_noise_ref(seed, tidx, V).double()
    assert abs(g.mean().item() - 0.5772156649) < 0.01  # Euler-Mascheroni
    assert abs(g.var().item() - math.pi ** 2 / 6) < 0.03
    assert g.max() < 17.4 and g.min() > -2.86
    # rows of neighbouring seeds / token indices are uncorrelated
    c = torch.corrcoef(g.float())
    off_diag = c - torch.eye(B)
    assert off_diag.abs().max() < 0.08


def test_noise_uses_both_seed_words_and_token_index():
    V = 1000
    base = random_bits_ref(torch.tensor([12345]), torch.tensor([3], dtype=torch.int32), V)
    for seed, tidx in [(12345 + 2**32, 3), (12345 - 2**63, 3), (12346, 3), (12345, 4)]:
        other = random_bits_ref(torch.tensor([seed]), torch.tensor([tidx], dtype=torch.int32), V)
        assert (other != base).float().mean() > 0.99


# ----------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("use_triton", [False, True])
def test_greedy_is_argmax(use_triton):
    B, V = 5, 300
    logits = _logits(B, V, 1)
    logits[2, 17] = logits[2, 250] = logits[2].max() + 1.0  # tie: the first index wins
    logits[3, 81] = logits[3, 145] = logits[3].max() + 1.0  # a tie in one lane of the kernel (block 64)
    t = _tensors(B, temperature=[0.0] * B, seed=[1, 2, 3, 4, 5], top_k=[3] * B)
    expected = logits.argmax(dim=-1).to(torch.int32)
    assert expected[2] == 17 and expected[3] == 81
    for flags in (OFF, TOPKP):
        out = sample(logits, t, flags, use_triton=use_triton, block_v=64)
        assert out.tokens.dtype == torch.int32
        assert torch.equal(out.tokens, expected)
        assert out.logprobs is None and out.logprob_token_ids is None


# ----------------------------------------------------------------------------- reproducibility


def test_draw_depends_only_on_seed_and_token_index():
    V = 400
    row_logits = _logits(4, V, 2, scale=1.0)
    seeds, tidx, temps = [11, -7, 2**50, 11], [0, 5, 9, 6], [1.0, 0.7, 1.5, 1.0]
    solo = []
    for i in range(4):
        t = _tensors(1, temperature=[temps[i]], seed=[seeds[i]], token_index=[tidx[i]])
        solo.append(sample_ref(row_logits[i:i + 1], t, OFF).tokens.item())
    # the same requests inside a bigger batch, shuffled, with greedy / other rows around them
    order = [3, 0, 2, 1]
    extra = _logits(3, V, 3)
    logits = torch.cat([extra[:1], row_logits[order], extra[1:]])
    t = _tensors(6, temperature=[0.0] + [temps[i] for i in order] + [0.9, 1.0],
                 seed=[5] + [seeds[i] for i in order] + [77, 78],
                 token_index=[0] + [tidx[i] for i in order] + [1, 2])
    batched = sample_ref(logits, t, OFF).tokens.tolist()[1:5]
    assert batched == [solo[i] for i in order]
    # the Triton kernel agrees, with a different vocabulary split
    tri = sample(logits, t, OFF, use_triton=True, num_splits=2, block_v=128).tokens.tolist()[1:5]
    assert tri == batched


def test_token_index_and_seed_change_draws():
    V, N = 1000, 200
    logits = torch.zeros(N, V, device=DEV)  # uniform
    same_seed = sample_ref(logits, _tensors(N, seed=[42] * N, token_index=list(range(N))), OFF)
    assert len(set(same_seed.tokens.tolist())) > 150  # ~181 expected for 200 uniform draws
    same_index = sample_ref(logits, _tensors(N, seed=list(range(N)), token_index=[7] * N), OFF)
    assert len(set(same_index.tokens.tolist())) > 150
    # deterministic
    again = sample_ref(logits, _tensors(N, seed=[42] * N, token_index=list(range(N))), OFF)
    assert torch.equal(same_seed.tokens, again.tokens)


# ----------------------------------------------------------------------------- distribution


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
@pytest.mark.quick_sample(1)
def test_frequencies_match_softmax(temperature):
    N, V = 6000, 8
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 1.2, -3.0, 0.3], device=DEV)
    logits = row.expand(N, V).contiguous()
    t = _tensors(N, temperature=[temperature] * N, seed=[s * 31 + 1 for s in range(N)],
                 token_index=[s % 13 for s in range(N)])
    tokens = sample_ref(logits, t, OFF).tokens
    _assert_frequencies(tokens, torch.softmax(row / temperature, 0), N)
    # one request over many token indices draws from the same distribution
    t = _tensors(N, temperature=[temperature] * N, seed=[123] * N, token_index=list(range(N)))
    _assert_frequencies(sample_ref(logits, t, OFF).tokens, torch.softmax(row / temperature, 0), N)


def test_filtered_frequencies():
    N, V = 6000, 10
    row = torch.tensor([2.0, 1.5, 1.0, 0.9, 0.5, 0.0, -0.5, -1.0, 1.9, 0.2], device=DEV)
    logits = row.expand(N, V).contiguous()
    p = torch.softmax(row, 0)
    order = p.argsort(descending=True)
    # sorted probabilities .259 .234 .157 .095 ...; mass before them: 0 .259 .493 .649 .744
    # top-4 renormalised: .347 .314 .211 .128; mass before: 0 .347 .661
    cases = {
        "top_k=3": (dict(top_k=[3] * N), order[:3]),
        "top_p=0.7": (dict(top_p=[0.7] * N), order[:4]),
        "top_p=0.2": (dict(top_p=[0.2] * N), order[:1]),
        # p / p_max >= 0.3 keeps tokens with logit >= 2 + log(0.3) = 0.796
        "min_p=0.3": (dict(min_p=[0.3] * N), torch.nonzero(row >= 2.0 + math.log(0.3)).flatten()),
        "top_k=4,top_p=0.5": (dict(top_k=[4] * N, top_p=[0.5] * N), order[:2]),
        "top_k=4,top_p=0.7": (dict(top_k=[4] * N, top_p=[0.7] * N), order[:3]),
    }
    for name, (kw, kept) in cases.items():  # the same sets, computed independently
        assert _allowed_set(row.cpu().numpy(), kw.get("top_k", [0])[0], kw.get("top_p", [1.0])[0],
                            kw.get("min_p", [0.0])[0]) == set(kept.tolist()), name
    for name, (kw, kept) in cases.items():
        t = _tensors(N, seed=list(range(N)), token_index=[1] * N, **kw)
        tokens = sample_ref(logits, t, TOPKP).tokens
        target = torch.zeros(V, device=DEV)
        target[kept] = p[kept]
        _assert_frequencies(tokens, target / target.sum(), N)


def _allowed_set(scaled_row: np.ndarray, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Independent, per-row computation of the kept set (float64 probabilities)."""
    V = scaled_row.size
    order = np.argsort(-scaled_row, kind="stable")
    allowed = np.ones(V, dtype=bool)
    if 0 < top_k < V:
        allowed &= scaled_row >= scaled_row[order[top_k - 1]]
    if top_p < 1.0:
        ks = order[: (top_k if 0 < top_k < V else V)]
        vals = scaled_row[ks].astype(np.float64)
        probs = np.exp(vals - vals.max())
        probs /= probs.sum()
        n = max(1, int(np.sum(np.cumsum(probs) - probs < top_p)))
        allowed &= scaled_row >= scaled_row[ks[n - 1]]
    if min_p > 0:
        allowed &= scaled_row >= scaled_row.max() + np.float32(math.log(min_p))
    return set(np.nonzero(allowed)[0].tolist())


def test_filters_never_leave_the_kept_set():
    B, V, draws = 12, 60, 300
    rng = np.random.default_rng(0)
    logits = _logits(B, V, 4, scale=2.0)
    temps = rng.uniform(0.3, 2.0, B).astype(np.float32)
    top_k = rng.choice([0, 1, 2, 5, 20], B).tolist()
    top_p = rng.choice([1.0, 0.95, 0.5, 0.1], B).tolist()
    min_p = rng.choice([0.0, 0.05, 0.5], B).tolist()
    hit = [set() for _ in range(B)]
    allowed = []
    for i in range(B):
        scaled = (logits[i].cpu() * (1.0 / torch.tensor(temps[i]))).numpy()
        allowed.append(_allowed_set(scaled, top_k[i], top_p[i], min_p[i]))
    rows = torch.arange(B).repeat(draws)
    n = rows.numel()
    t = _tensors(n, temperature=temps[rows.numpy()].tolist(), top_k=[top_k[r] for r in rows],
                 top_p=[top_p[r] for r in rows], min_p=[min_p[r] for r in rows],
                 seed=list(range(n)), token_index=[3] * n)
    tokens = sample_ref(logits[rows.to(DEV)], t, TOPKP).tokens.tolist()
    for r, tok in zip(rows.tolist(), tokens):
        assert tok in allowed[r], (r, tok, allowed[r])
        hit[r].add(tok)
    # and the filters are not stricter than asked: frequent kept tokens do show up
    for r in range(B):
        scaled = logits[r].cpu().double() / float(temps[r])
        p = torch.softmax(scaled, 0)
        kept = sorted(allowed[r])
        pk = p[kept] / p[kept].sum()
        likely = {v for v, q in zip(kept, pk.tolist()) if q * draws > 8}
        assert likely <= hit[r], (r, likely - hit[r])


# ----------------------------------------------------------------------------- penalties


def _direct_penalties(logits, prompt, outputs, rep, pres, freq):
    out = logits.clone()
    V = logits.shape[1]
    for b in range(logits.shape[0]):
        for v in range(V):
            count = outputs[b].count(v)
            x = float(logits[b, v])
            if v in prompt[b] or count > 0:
                x = x / rep[b] if x > 0 else x * rep[b]
            x -= freq[b] * count + pres[b] * (1.0 if count > 0 else 0.0)
            out[b, v] = x
    return out


def test_penalties_equal_direct_computation():
    V = 40
    prompts = [[1, 2, 3, 3], [], [5, 39], [0]]
    outputs = [[2, 2, 7], [4, 4, 4, 9], [], [0, 0, 1]]
    rep, pres, freq = [1.3, 0.8, 2.0, 1.0], [0.5, 0.0, -1.0, 0.7], [0.25, 1.5, 0.0, -0.5]
    state = PenaltyState(6, V, DEV)
    rows = [4, 0, 2, 5]
    for r, p, o in zip(rows, prompts, outputs):
        state.reset_row(r, p, o)
    logits = _logits(4, V, 5)
    t = _tensors(4, temperature=[0.0] * 4, repetition_penalty=rep, presence_penalty=pres,
                 frequency_penalty=freq, state_row=rows)
    expected = _direct_penalties(logits.cpu(), prompts, outputs, rep, pres, freq)
    got = apply_penalties(logits, t, state)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-6)
    flags = SamplerFlags(False, True, 0)
    for use_triton in (False, True):
        out = sample(logits, t, flags, state, use_triton=use_triton, block_v=16)
        assert torch.equal(out.tokens.cpu(), expected.argmax(-1).to(torch.int32))
    # penalties off -> logits unchanged
    t_off = _tensors(4, state_row=rows)
    assert torch.equal(apply_penalties(logits, t_off, state), logits)


def test_penalty_state_record_and_reset():
    V = 10
    state = PenaltyState(4, V, DEV)
    state.reset_row(1, [3, 3, 4], [5, 5, 6])
    assert state.prompt_mask[1].nonzero().flatten().tolist() == [3, 4]
    assert state.output_counts[1].tolist() == [0, 0, 0, 0, 0, 2, 1, 0, 0, 0]
    rows = torch.tensor([1, 3, 3, 3, 0], dtype=torch.int32, device=DEV)  # row 3: scratch, repeated
    toks = torch.tensor([5, 2, 2, 9, 0], dtype=torch.int32, device=DEV)
    state.record(rows, toks)
    assert state.output_counts[1, 5] == 3
    assert state.output_counts[3].tolist() == [0, 0, 2, 0, 0, 0, 0, 0, 0, 1]
    assert state.output_counts[0].tolist() == [1] + [0] * 9
    assert state.output_counts[2].sum() == 0
    state.reset_row(1, torch.tensor([7]), [])  # reuse the row for a new request
    assert state.prompt_mask[1].nonzero().flatten().tolist() == [7]
    assert state.output_counts[1].sum() == 0


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax():
    B, V, k = 4, 50, 5
    logits = _logits(B, V, 6)
    state = PenaltyState(B, V, DEV)
    for r in range(B):
        state.reset_row(r, [0, 1, 2], [int(logits[r].argmax())])
    t = _tensors(B, temperature=[0.0, 0.5, 1.0, 2.0], top_k=[0, 3, 0, 0],
                 repetition_penalty=[1.5] * B, frequency_penalty=[0.3] * B, state_row=[0, 1, 2, 3],
                 seed=[9, 8, 7, 6])
    flags = SamplerFlags(True, True, k)
    ref = sample_ref(logits, t, flags, state)
    lp = torch.log_softmax(logits.float(), -1)  # before penalties and temperature
    assert ref.logprobs.shape == (B, 1 + k) and ref.logprob_token_ids.shape == (B, k)
    assert ref.logprob_token_ids.dtype == torch.int32 and ref.logprobs.dtype == torch.float32
    torch.testing.assert_close(ref.logprobs[:, 0], lp.gather(1, ref.tokens.long()[:, None])[:, 0])
    top_vals, top_ids = lp.topk(k, -1)
    torch.testing.assert_close(ref.logprobs[:, 1:], top_vals)
    assert torch.equal(ref.logprob_token_ids, top_ids.to(torch.int32))
    assert torch.equal(ref.logprob_ids, ref.logprob_token_ids)  # runner's alias
    tri = sample(logits, t, flags, state, use_triton=True, block_v=32)
    assert torch.equal(tri.tokens, ref.tokens)
    torch.testing.assert_close(tri.logprobs, ref.logprobs, atol=0, rtol=0)


# ----------------------------------------------------------------------------- Triton == torch


def _mixed_rows(B, seed):
    rng = np.random.default_rng(seed)
    return dict(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.7], B).tolist(),
        top_k=rng.choice([0, 0, 1, 7, 40], B).tolist(),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.3], B).tolist(),
        min_p=rng.choice([0.0, 0.0, 0.02, 0.3], B).tolist(),
        seed=rng.integers(-2**62, 2**62, B).tolist(),
        token_index=rng.integers(0, 5000, B).tolist(),
    )


@pytest.mark.parametrize("flags,num_splits,block_v,dtype", [
    (OFF, 1, 128, torch.float32),
    (OFF, 3, 128, torch.float32),
    (OFF, 2, 128, torch.bfloat16),  # model-dtype logits go to the kernel as they are
    (TOPKP, 1, 256, torch.float32),
    (TOPKP, 4, 64, torch.bfloat16),
])
@pytest.mark.quick_sample(1)
def test_triton_tokens_equal_torch(flags, num_splits, block_v, dtype):
    B, V = 8, 1000
    logits = _logits(B, V, 7, scale=2.0).to(dtype)
    kw = _mixed_rows(B, num_splits * 10 + block_v)
    if not flags.use_top_k_top_p:
        kw.pop("top_k"), kw.pop("top_p")
    t = _tensors(B, **kw)
    ref = sample_ref(logits, t, flags)
    tri = sample(logits, t, flags, use_triton=True, num_splits=num_splits, block_v=block_v)
    assert torch.equal(tri.tokens, ref.tokens), (tri.tokens, ref.tokens)


@pytest.mark.parametrize("flags", [OFF, TOPKP])
@pytest.mark.slow
def test_triton_min_p_boundary(flags):
    # token 0 has p_max; tokens 1..99 sit at 0.35 p_max (kept by min_p 0.3), 100..199 at 0.25
    B, V = 16, 200
    row = torch.cat([torch.zeros(1), torch.full((99,), math.log(0.35)), torch.full((100,), math.log(0.25))])
    logits = row.expand(B, V).contiguous().to(DEV)
    t = _tensors(B, min_p=[0.3] * B, seed=list(range(B)), token_index=[2] * B)
    ref = sample_ref(logits, t, flags).tokens
    assert ref.max() < 100 and (ref > 0).sum() > B // 2
    for num_splits in (1, 2):
        tri = sample(logits, t, flags, use_triton=True, num_splits=num_splits, block_v=64).tokens
        assert torch.equal(tri, ref)


@pytest.mark.slow
def test_triton_peaked_logits_skip_chunks():
    # one dominant token per row at varying places: most chunks are skipped by the kernel
    B, V = 6, 997
    logits = _logits(B, V, 8, scale=1.0)
    hot = torch.tensor([0, 996, 500, 128, 129, 300])
    logits[torch.arange(B), hot.to(DEV)] += 30.0
    logits[2, 900] = logits[2, 500] - 1.0  # a close second far away
    t = _tensors(B, temperature=[1.0, 0.3, 1.0, 2.0, 1.0, 0.8], seed=[1, 2, 3, 4, 5, 6],
                 min_p=[0.0, 0.0, 0.0, 0.1, 0.0, 0.0])
    for num_splits in (1, 4):
        ref = sample_ref(logits, t, OFF)
        tri = sample(logits, t, OFF, use_triton=True, num_splits=num_splits, block_v=64)
        assert torch.equal(tri.tokens, ref.tokens)
    # with many seeds, the close second of row 2 does get drawn (chunk skip is not a cutoff)
    N = 64
    rows = torch.full((N,), 2)
    t = _tensors(N, seed=list(range(N)), token_index=[0] * N)
    ref = sample_ref(logits[rows.to(DEV)], t, OFF).tokens
    assert {500, 900} <= set(ref.tolist())


def test_sampler_output_and_flags_types():
    flags = SamplerFlags(True, False, 3)
    assert hash(flags) == hash(SamplerFlags(True, False, 3))  # usable in graph keys
    out = sample_ref(_logits(2, 16, 9), _tensors(2), OFF)
    assert isinstance(out, SamplerOutput) and out.tokens.shape == (2,)
    empty = sample_ref(torch.zeros(0, 16, device=DEV), _tensors(0), OFF)
    assert empty.tokens.shape == (0,)


# ----------------------------------------------------------------------------- GPU


def _big_batch(B, V, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, V, generator=g) * 4).cuda()
    kw = _mixed_rows(B, seed)
    return logits, _tensors(B, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [OFF, TOPKP, SamplerFlags(True, True, 20)])
def test_gpu_triton_matches_torch_real_vocab(flags):
    B, V = 96, 151936
    logits, t = _big_batch(B, V, 11)
    state = PenaltyState(B + 1, V, "cuda")
    for r in range(B):
        state.reset_row(r, list(range(r, r + 50)), list(range(r * 3, r * 3 + 20)))
    t.state_row = torch.arange(B, dtype=torch.int32, device="cuda")
    t.repetition_penalty = torch.full((B,), 1.2, device="cuda")
    ref = sample_ref(logits, t, flags, state)
    for splits in (None, 1):
        tri = sample(logits, t, flags, state, num_splits=splits)
        # float log differs between torch and Triton on the GPU: only near-exact ties may differ
        assert (tri.tokens != ref.tokens).sum().item() <= 1
    if flags.num_logprobs:
        same = tri.tokens == ref.tokens
        torch.testing.assert_close(tri.logprobs[same], ref.logprobs[same])
        assert torch.equal(tri.logprob_token_ids, ref.logprob_token_ids)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_timing():
    B, V = 256, 151936
    logits, t = _big_batch(B, V, 12)
    state = PenaltyState(B + 1, V, "cuda")
    for flags in (OFF, TOPKP):
        eager = sample(logits, t, flags, state)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = sample(logits, t, flags, state)
            state.record(t.state_row, out.tokens)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.tokens, eager.tokens)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        print(f"sample B={B} V={V} {flags}: {start.elapsed_time(end) / 20 * 1e3:.1f} us per step")


@pytest.mark.slow
def test_host_scalars_equal_the_samplers_own():
    # the runner computes inv_t and log(min_p) on the host (inputs.sampling_scalars); the
    # sampler derives them on the device when they are not given: same values, same tokens
    from types import SimpleNamespace

    from slipstream.runner.inputs import sampling_scalars
    from slipstream.sampling.sampler import _row_scalars

    B, V = 8, 700
    kw = _mixed_rows(B, 5)
    kw["temperature"][:3] = [0.0, 1e-6, 0.6]
    kw["min_p"][:3] = [0.0, 0.05, 1.0]
    host = SimpleNamespace(temperature=np.array(kw["temperature"], np.float32),
                           min_p=np.array(kw["min_p"], np.float32),
                           inv_t=np.zeros(B, np.float32), log_min_p=np.zeros(B, np.float32))
    sampling_scalars(host, B)
    t = _tensors(B, **kw)
    _, inv_t, log_min_p = _row_scalars(t)
    assert torch.equal(torch.from_numpy(host.inv_t), inv_t.cpu())
    torch.testing.assert_close(torch.from_numpy(host.log_min_p), log_min_p.cpu(), rtol=1e-6, atol=0)
    t_host = _tensors(B, **kw)
    t_host.inv_t = torch.from_numpy(host.inv_t).to(DEV)
    t_host.log_min_p = torch.from_numpy(host.log_min_p).to(DEV)
    logits = _logits(B, V, 11)
    out = torch.full((B,), -1, dtype=torch.int32, device=DEV)
    for flags in (OFF, TOPKP):
        for use_triton in (False, True):
            got = sample(logits, t_host, flags, use_triton=use_triton, block_v=128, out=out)
            assert got.tokens.data_ptr() == out.data_ptr()  # written in place
            assert torch.equal(out, sample_ref(logits, t, flags).tokens)
