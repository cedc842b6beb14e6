"""The token bitmask of structured outputs inside the sampler: the torch path and the Triton
kernel (on the GPU, or its interpreter on the CPU) draw only allowed tokens, agree with each
other on the same device, and equal sampling the masked logits; logprobs are those of the
constrained distribution."""
import pytest
import torch

from slipstream.sampling.grammar.bitmask import allocate_bitmask, fill_only_allowed
from slipstream.sampling.sampler import SamplerFlags, SamplingTensors, masked_logits, sample

V = 300  # not a multiple of 32: the last word is partial
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # both paths run here (the Triton kernel must)


def make_case(top: bool):
    gen = torch.Generator().manual_seed(0)
    B = 6
    logits = torch.randn(B, V, generator=gen) * 3
    bitmask = allocate_bitmask(B, V)
    words = torch.randint(-2**31, 2**31 - 1, bitmask.shape, generator=gen, dtype=torch.int64)
    bitmask[1:4] = words[1:4].to(torch.int32)  # rows 1-3: random halves of the vocabulary
    fill_only_allowed(bitmask, 4, [299])  # row 4: only the last token (in the partial word)
    fill_only_allowed(bitmask, 5, [7, 250])
    t = SamplingTensors.from_lists(
        [0.0, 0.9, 0.0, 1.3, 0.7, 2.0], seed=[1, 2, 3, 4, 5, 6], token_index=[0, 3, 1, 9, 2, 4],
        top_k=[0, 20, 0, 0, 0, 0] if top else None, top_p=[1.0, 0.8, 1.0, 1.0, 1.0, 1.0] if top else None,
        min_p=[0.0, 0.0, 0.0, 0.1, 0.0, 0.0], device=DEVICE)
    t.bitmask = bitmask.to(DEVICE)
    flags = SamplerFlags(use_top_k_top_p=top, use_penalties=False, num_logprobs=3 if top else 0)
    return logits.to(DEVICE), t, flags


def allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


@pytest.mark.parametrize("top", [False, True])
def test_masked_sampling_torch_and_triton_agree_and_obey_the_mask(top):
    logits, t, flags = make_case(top)
    ref = sample(logits, t, flags, use_triton=False)
    tri = sample(logits, t, flags, use_triton=True, block_v=64)
    assert ref.tokens.tolist() == tri.tokens.tolist()
    for row, token in enumerate(ref.tokens.tolist()):
        assert allowed(t.bitmask, row, token)
    assert ref.tokens[4] == 299 and ref.tokens[5] in (7, 250)
    # the semantics: the same draw as from the masked logits with no mask
    plain = SamplingTensors(**{**t.__dict__, "bitmask": None})
    assert sample(masked_logits(logits, t.bitmask), plain, flags, use_triton=False).tokens.tolist() \
        == ref.tokens.tolist()
    # the greedy rows take the best allowed token
    for row in (0, 2):
        best = masked_logits(logits, t.bitmask)[row].argmax()
        assert ref.tokens[row] == best
    if flags.num_logprobs:  # logprobs of the constrained distribution
        torch.testing.assert_close(ref.logprobs, tri.logprobs)
        lp = torch.log_softmax(masked_logits(logits, t.bitmask), dim=-1)
        torch.testing.assert_close(ref.logprobs[:, 0], lp.gather(1, ref.tokens.long()[:, None])[:, 0])
        assert ref.logprobs[4, 0] == 0.0  # the only allowed token has all the mass


@pytest.mark.slow
def test_triton_reads_the_bitmask_with_splits():
    logits, t, flags = make_case(False)
    ref = sample(logits, t, flags, use_triton=False)
    tri = sample(logits, t, flags, use_triton=True, block_v=32, num_splits=4)
    assert tri.tokens.tolist() == ref.tokens.tolist()


def test_a_bitmask_of_the_wrong_shape_is_refused():
    logits, t, flags = make_case(False)
    t.bitmask = t.bitmask[:, :3]
    with pytest.raises(ValueError, match="bitmask must be int32"):
        sample(logits, t, flags, use_triton=True)
