"""The router's top-k kernel, `route_triton` (under TRITON_INTERPRET=1 on the CPU), against
`route_ref`, the torch path: the expert ids exactly and the weights within float32 rounding, on
tie-free logits (ties are ordered by torch's CPU topk as it happens to, so they get a test of
their own: lower expert id first). On a GPU the same tests run on CUDA tensors, and one replays
`route` in a CUDA graph on new logits."""
from __future__ import annotations

import pytest
import torch

from slipstream.ops.moe import route, route_ref
from slipstream.ops.triton_route import route_applies, route_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32 rounding: the softmax's sum over up to 512 terms may be added in another order than
# torch's (a few ulp of the total), then two divisions of half an ulp each
TOL = dict(rtol=3e-6, atol=1e-7)


def _tie_free_logits(num_tokens: int, num_experts: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Each row a random permutation of distinct values 1/16 apart (exact in bf16 up to 256
    experts), plus a random offset a row: no two experts of a row tie, before or after the
    softmax."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(num_experts, generator=g) for _ in range(num_tokens)])
    offset = torch.randint(-8, 8, (num_tokens, 1), generator=g)
    scale = 16.0 if num_experts <= 256 else 32.0  # 512 experts: 1/32 apart stays exact
    return ((ranks - num_experts // 2 + offset).float() / scale).to(dtype)


# (tokens, experts, k, renormalize)
CASES = [
    (1, 128, 8, True),  # the Qwen3-30B-A3B decode row
    (33, 128, 8, False),  # rows over a program's block
    (1, 8, 2, True),  # Mixtral's shape
    (33, 8, 2, False),
    (5, 60, 4, True),  # experts not a power of two
    (1, 60, 6, False),
    (3, 512, 16, True),  # the largest E and k the kernel takes
]


@pytest.mark.quick_sample(4)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,renormalize", CASES)
def test_route_triton_equals_the_torch_path(num_tokens, num_experts, top_k, renormalize, dtype):
    logits = _tie_free_logits(num_tokens, num_experts, dtype, seed=num_tokens * num_experts + top_k).to(DEVICE)
    want_w, want_ids = route_ref(logits, top_k, renormalize)
    weights, ids = route_triton(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (num_tokens, top_k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, **TOL)


def test_route_triton_on_gaussian_logits():
    # unstructured logits (a spread of magnitudes, -inf for experts that get no token) in
    # float32, where ties have probability zero
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(17, 128, generator=g) * 3
    logits[:, 100:] = float("-inf")
    logits = logits.to(DEVICE)
    want_w, want_ids = route_ref(logits, 8, True)
    weights, ids = route_triton(logits, 8, True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, **TOL)


def test_ties_go_to_the_lower_expert_id():
    # bf16 logits tie often; the order is a stable descending sort of the probabilities
    logits = torch.randn(9, 60, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    logits[0] = 0.0  # a whole row tied: experts 0..k-1
    logits = logits.to(DEVICE)
    probs = torch.softmax(logits.float(), -1)
    want_p, want_ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = route_triton(logits, 5, renormalize=False)
    assert torch.equal(ids, want_ids[:, :5].to(torch.int32))
    assert ids[0].tolist() == [0, 1, 2, 3, 4]
    torch.testing.assert_close(weights, want_p[:, :5], **TOL)


def test_route_triton_writes_into_given_buffers_and_reads_strided_rows():
    wide = _tie_free_logits(6, 96, torch.float32, seed=5).to(DEVICE)
    logits = wide[:, :64]  # rows 96 apart
    out = (torch.full((6, 4), -1.0, device=DEVICE), torch.full((6, 4), -1, dtype=torch.int32, device=DEVICE))
    weights, ids = route_triton(logits, 4, True, out=out)
    assert weights is out[0] and ids is out[1]
    want_w, want_ids = route_ref(logits, 4, True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, **TOL)


def test_shapes_the_kernel_does_not_take():
    assert route_applies(torch.zeros(2, 512), 16)
    assert not route_applies(torch.zeros(2, 513), 8)  # E over one register tile
    assert not route_applies(torch.zeros(2, 64), 17)  # k over the unrolled picks
    assert not route_applies(torch.zeros(2, 4), 5)  # k over E
    assert not route_applies(torch.zeros(2, 3, 8), 2)
    with pytest.raises(ValueError, match="route_triton"):
        route_triton(torch.zeros(2, 4), 5, True)


@pytest.mark.gpu
def test_route_dispatches_to_the_kernel_and_replays_in_a_cuda_graph():
    dev = torch.device("cuda")
    logits = torch.zeros(4, 128, device=dev, dtype=torch.bfloat16)
    weights = torch.zeros(4, 8, device=dev)
    ids = torch.zeros(4, 8, device=dev, dtype=torch.int32)

    def step():
        w, i = route(logits, 8, renormalize=True)
        weights.copy_(w)
        ids.copy_(i)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (1, 2, 3):
        logits.copy_(_tie_free_logits(4, 128, torch.bfloat16, seed))
        graph.replay()
        want_w, want_ids = route_ref(logits, 8, True)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_w, **TOL)
