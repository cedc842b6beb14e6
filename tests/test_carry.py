import pytest
import torch

from slipstream.ops.carry import carry_over_ref, carry_over_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton kernel runs


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
    a, b = ids.clone(), ids.to(DEVICE, copy=True)
    carry_over_ref(a, carry, prev)
    carry_over_triton(b, carry.to(DEVICE), prev.to(DEVICE))
    assert torch.equal(a, expected) and torch.equal(b.cpu(), expected)
