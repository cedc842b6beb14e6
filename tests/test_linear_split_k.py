"""ops/linear.py's few-row K split (SLIPSTREAM_SPLIT_K, an A/B knob): the split product and the
in-place residual form equal the plain product within bf16 rounding, and the rule takes only
2..ROWS rows of weights up to MAX_N outputs whose K divides by S (on CUDA)."""
import pytest
import torch

from slipstream.ops import linear as L


@pytest.mark.parametrize("S", [2, 4])
def test_split_product_and_its_residual_form_equal_the_plain_product(monkeypatch, S):
    torch.manual_seed(0)
    x, w = torch.randn(4, 256, dtype=torch.bfloat16), torch.randn(96, 256, dtype=torch.bfloat16) * 0.05
    want = x.float() @ w.float().t()
    got = L._split_product(x, w, S)
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-3, rtol=1e-3)
    monkeypatch.setattr(L, "_split_k", lambda x, w: S)
    out = torch.randn(4, 96, dtype=torch.bfloat16)
    expect = (out.float() + want).to(torch.bfloat16)
    res = L.linear_add_(out, x, w)
    assert res.data_ptr() == out.data_ptr()
    assert torch.allclose(out.float(), expect.float(), atol=2e-2, rtol=1e-2)
    assert torch.allclose(L.linear(x, w).float(), want.to(torch.bfloat16).float(), atol=2e-2, rtol=1e-2)


def test_the_rule_takes_few_rows_of_narrow_weights_on_cuda_only(monkeypatch):
    monkeypatch.setattr(L, "SPLIT_K", (8, 4, 8192))
    w = torch.empty(4096, 4096, dtype=torch.bfloat16)
    assert L._split_k(torch.empty(4, 4096, dtype=torch.bfloat16), w) == 1  # (CPU)

    class Cuda:
        is_cuda = True

        def __init__(self, m, k):
            self.shape = (m, k)

        def numel(self):
            return self.shape[0] * self.shape[1]

        def dim(self):
            return 2

    assert L._split_k(Cuda(4, 4096), w) == 4
    assert L._split_k(Cuda(1, 4096), w) == 1 and L._split_k(Cuda(9, 4096), w) == 1
    assert L._split_k(Cuda(4, 4096), torch.empty(28672, 4096)) == 1
    assert L._split_k(Cuda(4, 4098), torch.empty(4096, 4098)) == 1
    monkeypatch.setattr(L, "SPLIT_K", (0, 1, 0))
    assert L._split_k(Cuda(4, 4096), w) == 1
