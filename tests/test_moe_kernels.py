"""The fused MoE layer's Triton kernels (on the GPU, or under TRITON_INTERPRET=1 on the CPU)
against the per-expert loop, `fused_moe_ref` (on the CPU): the sort and pad by expert, and the
two grouped GEMMs at tiny sizes, including a step where some experts get no token, one where every token routes
to the same experts, one row (decode), and bf16; untouched experts' weights are never read."""
from __future__ import annotations

import pytest
import torch

from slipstream.ops.moe import fused_moe_ref, route
from slipstream.ops.triton_moe import MoEConfig, align_by_expert, fused_moe_triton, moe_config
from test_attention_kernels import DEVICE, tolerances

HIDDEN, INTER = 64, 32
SMALL = MoEConfig(block_m=16, block_n=32, block_k=32)
# float32 dots are IEEE on both; the GPU sums in another order (and its exp is approximate)
F32_TOL = (dict(rtol=1e-5, atol=1e-5) if DEVICE == "cpu"
           else dict(zip(("atol", "rtol"), tolerances(torch.float32))))


def _dev(*tensors: torch.Tensor):
    """The tensors on DEVICE, where the Triton kernels run (the references stay on the CPU)."""
    return tuple(t.to(DEVICE) for t in tensors)


def _weights(num_experts: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w_gate_up = (torch.randn(num_experts, 2 * INTER, HIDDEN, generator=g) * 0.2).to(dtype)
    w_down = (torch.randn(num_experts, HIDDEN, INTER, generator=g) * 0.2).to(dtype)
    return w_gate_up, w_down


def _routing(num_tokens: int, num_experts: int, top_k: int, seed: int, only: list[int] | None = None):
    """Router logits -> (weights, ids); `only`: every other expert's logit -inf (gets no token)."""
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed))
    if only is not None:
        keep = torch.full((num_experts,), float("-inf"))
        keep[only] = 0.0
        logits = logits + keep
    return route(logits, top_k, renormalize=True)


def test_route_renormalises_only_when_asked():
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    probs = torch.softmax(logits, -1)
    plain, ids = route(logits, 3, renormalize=False)
    norm, ids2 = route(logits, 3, renormalize=True)
    assert ids.dtype == torch.int32 and torch.equal(ids, ids2)
    assert torch.equal(plain, probs.gather(1, ids.long()))
    torch.testing.assert_close(norm, plain / plain.sum(-1, keepdim=True))
    torch.testing.assert_close(norm.sum(-1), torch.ones(5))


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [(1, 8, 2, 16), (9, 6, 3, 16), (40, 4, 2, 32)])
def test_align_groups_pads_and_names_the_experts(num_tokens, num_experts, top_k, block_m):
    _, ids = _routing(num_tokens, num_experts, top_k, seed=num_tokens)
    a = align_by_expert(*_dev(ids), num_experts, block_m)
    n = ids.numel()
    flat = ids.reshape(-1).tolist()
    counts = [flat.count(e) for e in range(num_experts)]
    padded = [-(-c // block_m) * block_m for c in counts]
    assert a.num_padded.item() == sum(padded)
    assert a.num_blocks * block_m >= sum(padded)  # the fixed capacity bounds any routing
    pos = 0
    for e in range(num_experts):
        segment = a.sorted_ids[pos:pos + padded[e]].tolist()
        # the expert's assignments (in any order), then the sentinel n up to the block's end
        assert sorted(segment[:counts[e]]) == [s for s in range(n) if flat[s] == e]
        assert segment[counts[e]:] == [n] * (padded[e] - counts[e])
        assert a.expert_of_block[pos // block_m:(pos + padded[e]) // block_m].tolist() == [e] * (padded[e] // block_m)
        pos += padded[e]
    assert a.expert_of_block[pos // block_m:].tolist() == [-1] * (a.num_blocks - pos // block_m)


CASES = {
    # (tokens, experts, top_k, experts that get tokens (None: any))
    "decode row": (1, 8, 2, None),
    "some experts idle": (7, 8, 2, [1, 4, 6]),
    "same experts for every token": (5, 6, 3, [0, 2, 5]),
    "more rows than a block": (37, 4, 2, None),
}


@pytest.mark.quick_sample(2)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_moe_equals_the_per_expert_loop(case):
    num_tokens, num_experts, top_k, only = CASES[case]
    w_gate_up, w_down = _weights(num_experts)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(3))
    weights, ids = _routing(num_tokens, num_experts, top_k, seed=4, only=only)
    if only is not None:
        assert set(ids.unique().tolist()) <= set(only)
    ref = fused_moe_ref(x, w_gate_up, w_down, weights, ids)
    out = fused_moe_triton(*_dev(x, w_gate_up, w_down, weights, ids), SMALL)
    torch.testing.assert_close(out.cpu(), ref, **F32_TOL)


def test_fused_moe_bf16_and_the_default_tiles():
    w_gate_up, w_down = _weights(8, torch.bfloat16)
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    weights, ids = _routing(6, 8, 2, seed=6)
    ref = fused_moe_ref(x, w_gate_up, w_down, weights, ids)
    out = fused_moe_triton(*_dev(x, w_gate_up, w_down, weights, ids))  # moe_config's tiles, clipped
    assert out.dtype == torch.bfloat16
    atol, rtol = tolerances(torch.bfloat16)
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=rtol, atol=atol)


def test_only_the_routed_experts_weights_are_read():
    # the idle experts' weights are NaN: any read of them would reach the output
    w_gate_up, w_down = _weights(8)
    weights, ids = _routing(1, 8, 2, seed=7)
    idle = [e for e in range(8) if e not in ids.tolist()[0]]
    w_gate_up[idle] = float("nan")
    w_down[idle] = float("nan")
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(8))
    out = fused_moe_triton(*_dev(x, w_gate_up, w_down, weights, ids), SMALL).cpu()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, fused_moe_ref(x, w_gate_up, w_down, weights, ids), **F32_TOL)


def test_tiles_grow_with_the_rows_per_expert():
    assert moe_config(8, 128).block_m == 16  # decode: one row per touched expert
    assert moe_config(64 * 128, 128).block_m == 32
    assert moe_config(8192 * 8, 128).block_m == 64


@pytest.mark.gpu
def test_fused_moe_replays_in_a_cuda_graph_with_new_routing():
    # captured once, replayed on other tokens and routings: nothing in the layer depends on
    # the host seeing the routing (no sync, fixed buffers)
    dev = torch.device("cuda")
    w_gate_up, w_down = (w.to(dev, torch.bfloat16) for w in _weights(16))
    x = torch.zeros(24, HIDDEN, device=dev, dtype=torch.bfloat16)
    logits = torch.zeros(24, 16, device=dev)
    out = torch.zeros(24, HIDDEN, device=dev, dtype=torch.bfloat16)

    def step():
        weights, ids = route(logits, 4, renormalize=True)
        out.copy_(fused_moe_triton(x, w_gate_up, w_down, weights, ids))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed, only in ((1, None), (2, [3, 5, 7, 9]), (3, [0, 1, 2, 15])):
        g = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(24, HIDDEN, generator=g))
        new = torch.randn(24, 16, generator=g)
        if only is not None:  # the other experts get no token
            mask = torch.full((16,), float("-inf"))
            mask[only] = 0.0
            new = new + mask
        logits.copy_(new)
        graph.replay()
        weights, ids = route(logits, 4, renormalize=True)
        ref = fused_moe_ref(x, w_gate_up, w_down, weights, ids)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_fused_moe_adds_into_the_residual_stream_with_one_rounding():
    w_gate_up, w_down = _weights(8, torch.bfloat16)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    h = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    weights, ids = _routing(5, 8, 2, seed=11)
    want = (h.float() + fused_moe_ref(x, w_gate_up, w_down, weights, ids).float())
    ref_h, (tri_h,) = h.clone(), _dev(h.clone())
    assert fused_moe_ref(x, w_gate_up, w_down, weights, ids, residual=ref_h) is ref_h
    assert fused_moe_triton(*_dev(x, w_gate_up, w_down, weights, ids), SMALL, residual=tri_h) is tri_h
    scale = want.abs().max().item()  # a few bf16 steps of the largest value
    torch.testing.assert_close(ref_h.float(), want, rtol=0, atol=2e-2 * scale)
    torch.testing.assert_close(tri_h.cpu().float(), ref_h.float(), rtol=0, atol=2e-2 * scale)
