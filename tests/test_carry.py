import pytest
import torch

from slipstream.ops.carry import carry_over_ref, carry_over_triton


@pytest.mark.parametrize("n", [1, 37, 1500])
def test_carry_over_kernel_equals_reference(n):
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32)
    prev = torch.randint(0, 1000, (64,), generator=g, dtype=torch.int32)
    carry = torch.randint(-1, 64, (n,), generator=g, dtype=torch.int32)
    carry[::3] = -1
    expected = ids.clone()
    for i, src in enumerate(carry.tolist()):
        if src >= 0:
            expected[i] = prev[src]
    a, b = ids.clone(), ids.clone()
    carry_over_ref(a, carry, prev)
    carry_over_triton(b, carry, prev)
    assert torch.equal(a, expected) and torch.equal(b, expected)


@pytest.mark.parametrize("slot", [0, 1])
@pytest.mark.parametrize("n", [1, 37, 1500])
def test_shared_graph_carry_and_token_copy_choose_the_slot_on_the_device(n, slot):
    """A graph shared by the two slots carries from the slot other than the step's and
    writes the sampled tokens into the step's own; the Triton kernels equal the references."""
    from slipstream.ops.carry import carry_over_shared_ref, tokens_to_slot_ref
    from slipstream.ops.triton_carry import carry_over_shared_triton, tokens_to_slot_triton
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32)
    slot_tokens = tuple(torch.randint(0, 1000, (64,), generator=g, dtype=torch.int32) for _ in range(2))
    carry = torch.randint(-1, 64, (n,), generator=g, dtype=torch.int32)
    carry[::3] = -1
    index = torch.tensor([slot], dtype=torch.int32)
    expected = ids.clone()
    carry_over_ref(expected, carry, slot_tokens[1 - slot])
    a, b = ids.clone(), ids.clone()
    carry_over_shared_ref(a, carry, slot_tokens, index)
    carry_over_shared_triton(b, carry, slot_tokens, index)
    assert torch.equal(a, expected) and torch.equal(b, expected)
    sampled = torch.randint(0, 1000, (min(n, 64),), generator=g, dtype=torch.int32)
    want = [t.clone() for t in slot_tokens]
    want[slot][:len(sampled)] = sampled
    for copy in (tokens_to_slot_ref, tokens_to_slot_triton):
        got = tuple(t.clone() for t in slot_tokens)
        copy(sampled, got, index)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
