"""The router's top-k kernel, `route_triton` (under TRITON_INTERPRET=1 on the CPU), against
`route_ref`, the torch path: the expert ids exactly and the weights within float32 rounding, on
tie-free logits (ties are ordered by torch's CPU topk as it happens to, so they get a test of
their own: lower expert id first). The fused router linear, `route_linear_triton`, the same way
on inputs whose products sum exactly in any order. On a GPU the same tests run on CUDA tensors,
and two replay the kernels in a CUDA graph on new inputs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.ops.moe import route, route_ref
from slipstream.ops.triton_route import (
    new_route_counter,
    route_applies,
    route_linear_applies,
    route_linear_triton,
    route_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32 rounding: the softmax's sum over up to 512 terms may be added in another order than
# torch's (a few ulp of the total), then two divisions of half an ulp each
TOL = {"rtol": 3e-6, "atol": 1e-7}


def _tie_free_logits(num_tokens: int, num_experts: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Each row a random permutation of distinct integers n / 16 (n / 32 for 512 experts), plus
    a random offset a row: no two experts of a row tie, before or after the softmax. bf16 holds
    n / 2^s exactly only for |n| <= 256 (8 significant bits: from 8 up its step is 1/16), so the
    offset keeps every n in that range; an offset of +3 on 512 experts made 257/32 round to 8.0
    and tie with 256/32, whose order torch's CUDA topk and the kernel (lower id first) differ on."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(num_experts, generator=g) for _ in range(num_tokens)])
    low, high = -num_experts // 2, num_experts - 1 - num_experts // 2  # ranks - E/2 spans these
    offset = torch.randint(max(-8, -256 - low), min(8, 257 - high), (num_tokens, 1), generator=g)
    scale = 16.0 if num_experts <= 256 else 32.0
    logits = ((ranks - num_experts // 2 + offset).float() / scale).to(dtype)
    assert all(row.unique().numel() == num_experts for row in logits.float()), "the logits tie"
    return logits


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


def _stable_route(logits: torch.Tensor, top_k: int, renormalize: bool):
    """`route_ref` with ties to the lower expert id (a stable descending sort)."""
    probs = torch.softmax(logits.float(), -1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(torch.int32)


def _exact_router(num_tokens: int, num_experts: int, hidden: int, dtype: torch.dtype, seed: int):
    """x [T, H] and the router's weight [E, H] in eighths from -1/2 to 1/2: every product is a
    multiple of 1/64 and every sum of them is exact in float32, in any order, so the kernel's
    logits round to x's dtype exactly as F.linear's do. Triton's interpreter rounds float32 to
    bf16 toward zero (the GPU to nearest even, as torch), so there x has 4 nonzero entries a
    row: each logit is at most 1 in size, exact in bf16, and no rounding mode matters."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, (num_tokens, hidden), generator=g).float() / 8
    if DEVICE == "cpu" and dtype != torch.float32:
        keep = torch.rand(num_tokens, hidden, generator=g).argsort(-1)[:, :4]
        x = torch.zeros_like(x).scatter_(1, keep, x.gather(1, keep))
    w = torch.randint(-4, 5, (num_experts, hidden), generator=g).float() / 8
    return x.to(dtype).to(DEVICE), w.to(dtype).to(DEVICE)


# (tokens, experts, hidden, k, renormalize)
LINEAR_CASES = [
    (1, 128, 2048, 8, True),  # the Qwen3-30B-A3B decode row
    (16, 60, 96, 4, False),  # the most rows it takes; experts not a power of two
    (3, 8, 32, 2, True),  # Mixtral's k
    (5, 128, 200, 8, False),  # hidden not a power of two
]


@pytest.mark.slow
@pytest.mark.quick_sample(4)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_tokens,num_experts,hidden,top_k,renormalize", LINEAR_CASES)
def test_route_linear_triton_equals_linear_then_route(num_tokens, num_experts, hidden, top_k, renormalize, dtype):
    x, w = _exact_router(num_tokens, num_experts, hidden, dtype, seed=num_tokens + hidden)
    counter = new_route_counter(x.device)
    assert route_linear_applies(x, w, top_k)
    # the logits (multiples of 1/64 in a narrow range) tie often: ties to the lower id
    want_w, want_ids = _stable_route(F.linear(x.float(), w.float()).to(dtype), top_k, renormalize)
    for _ in range(2):  # the counter is back to zero after a call: a second call works alike
        weights, ids = route_linear_triton(x, w, top_k, renormalize, counter)
        assert counter.item() == 0
        assert weights.dtype == torch.float32 and ids.dtype == torch.int32
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_w, **TOL)


def test_route_linear_shapes_it_does_not_take():
    w = torch.zeros(128, 64)
    assert route_linear_applies(torch.zeros(16, 64), w, 8)
    assert not route_linear_applies(torch.zeros(17, 64), w, 8)  # prefill: the GEMM, then route
    assert not route_linear_applies(torch.zeros(1, 64, dtype=torch.bfloat16), w, 8)  # dtypes differ
    assert not route_linear_applies(torch.zeros(1, 16384), torch.zeros(128, 16384), 8)
    with pytest.raises(ValueError, match="route_linear_triton"):
        route_linear_triton(torch.zeros(17, 64), w, 8, True, new_route_counter(torch.device("cpu")))


@pytest.mark.gpu
def test_route_linear_replays_in_a_cuda_graph():
    # the counter must come back to zero on every replay, or the next one finds no last program
    x = torch.zeros(2, 2048, device="cuda", dtype=torch.bfloat16)
    w = _exact_router(1, 128, 2048, torch.bfloat16, seed=0)[1]
    counter = new_route_counter(x.device)
    weights = torch.zeros(2, 8, device="cuda")
    ids = torch.zeros(2, 8, device="cuda", dtype=torch.int32)

    def step():
        wt, i = route_linear_triton(x, w, 8, True, counter)
        weights.copy_(wt)
        ids.copy_(i)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(1, 6):
        x.copy_(_exact_router(2, 128, 2048, torch.bfloat16, seed)[0])
        graph.replay()
        want_w, want_ids = _stable_route(F.linear(x.float(), w.float()).to(torch.bfloat16), 8, True)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_w, **TOL)
    assert counter.item() == 0


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_moe_block_takes_the_fused_router_where_it_applies(kind, tmp_path, monkeypatch):
    # the block's decode-sized routing through `route_linear` (forced on the CPU: the kernel
    # under the interpreter) gives the block's output of its linear-then-route path
    from test_moe_model import make_moe_model

    import slipstream.model.moe as model_moe
    import slipstream.ops.moe as ops_moe
    from slipstream.model.loader import load_model

    make_moe_model(kind, str(tmp_path))
    model, _ = load_model(str(tmp_path))
    block = model.layers[0].mlp.to(DEVICE)  # on a GPU the kernel takes CUDA tensors only
    g = torch.Generator().manual_seed(4)
    h, x = torch.randn(3, 64, generator=g).to(DEVICE), torch.randn(3, 64, generator=g).to(DEVICE)
    with monkeypatch.context() as m:  # the linear, then route (on a GPU too)
        m.setattr(ops_moe, "FUSED_ROUTE_ROWS", 0)
        want = block(h.clone(), x)
    taken = []

    def applies(x, weight, top_k):
        taken.append(route_linear_applies(x, weight, top_k))
        return taken[-1]

    monkeypatch.setattr(model_moe, "route_linear_applies", applies)
    got = block(h.clone(), x)
    assert taken == [True] and int(block.route_counter.item()) == 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --- compiled for Hopper without a GPU (the interpreter misses what only the compiler rejects) ---
def compile_route_for_hopper() -> None:
    """Each router kernel compiled for sm_90 as the host code launches it: the top-k at one row
    (one warp), at 8192 rows, E=60, E=512 k=16; the fused router linear at 1 and 16 rows of
    the Qwen3-30B-A3B shape. Prints each one's registers and local memory (spills)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import kernel_resources as kr
    from test_attention_kernels import compile_launch_for_hopper, recorded_launches

    import slipstream.ops.triton_route as tr
    launches: list = []
    bf = torch.bfloat16
    with recorded_launches(tr, ["_route_kernel", "_route_linear_kernel"], launches):
        tr.route_triton(torch.zeros(1, 128, dtype=bf), 8, True)
        tr.route_triton(torch.zeros(8192, 128), 8, True)
        tr.route_triton(torch.zeros(7, 60, dtype=bf), 4, False)
        tr.route_triton(torch.zeros(3, 512, dtype=bf), 16, True)
        counter = tr.new_route_counter(torch.device("cpu"))
        tr.route_linear_triton(torch.zeros(1, 2048, dtype=bf), torch.zeros(128, 2048, dtype=bf), 8, True, counter)
        tr.route_linear_triton(torch.zeros(16, 2048, dtype=bf), torch.zeros(128, 2048, dtype=bf), 8, True, counter)
    for fn, args, kw in launches:
        compiled, _, opts = compile_launch_for_hopper(fn, args, kw)
        res = kr.resources(compiled.asm["cubin"])
        print("compiled", fn.__name__, opts["num_warps"], "warps", res)
        assert res["local"] == 0, f"{fn.__name__} spills: {res}"


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the GPU tests compile the kernels")
def test_route_kernels_compile_for_hopper():
    from helpers import run_hopper_compile
    out = run_hopper_compile(__file__)
    assert out.count("compiled") == 6, out


if __name__ == "__main__":
    import sys
    if "--compile-for-hopper" in sys.argv:
        compile_route_for_hopper()
