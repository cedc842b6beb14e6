"""The MoE layer's post-attention RMSNorm inside the router's launch (`route_linear_norm_triton`,
under TRITON_INTERPRET=1 on the CPU, on CUDA tensors where a GPU exists): the normalised rows it
writes against `rms_norm`'s kernel (bit for bit on the CPU) and its reference, its routing
against the unfused router on those rows (bit for bit), at 1-4 and 16 rows with non-trivial
norm weights and eps. `SparseMoeBlock.forward_norm` (forced onto the kernels on the CPU) against
`forward(h, rms_norm(h))` at 1-4 tokens through the small path's kernels, the whole model's
logits against transformers with the fusion, and the switch that keeps the norm apart. On a GPU:
replay in a CUDA graph at the Qwen3-30B-A3B shape."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_attention_kernels import DEVICE

import slipstream.model.moe as model_moe
import slipstream.ops.moe as ops_moe
import slipstream.ops.triton_route as tr
from slipstream.ops.fused import rms_norm_ref
from slipstream.ops.triton_fused import rms_norm_triton
from slipstream.ops.triton_moe_small import fused_moe_small
from slipstream.ops.triton_route import (
    new_route_counter,
    route_linear_norm_triton,
    route_linear_triton,
)

# (rows, experts, hidden, k, renormalize, eps)
CASES = [
    (1, 128, 2048, 8, True, 1e-6),  # the Qwen3-30B-A3B decode row
    (2, 60, 96, 4, False, 1e-5),  # experts not a power of two
    (3, 8, 32, 2, True, 0.5),  # Mixtral's k; an eps that moves the statistic
    (4, 128, 200, 8, False, 1e-6),  # hidden not a power of two
    (16, 60, 96, 4, True, 1e-2),  # the most rows the fused router takes
]


def _inputs(rows: int, experts: int, hidden: int, dtype: torch.dtype, seed: int):
    """The residual rows h (rows of different scales), a norm weight in [0.5, 1.5), the router."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g) * torch.linspace(0.05, 20.0, rows)[:, None]
    norm_w = torch.rand(hidden, generator=g) + 0.5
    w = torch.randn(experts, hidden, generator=g) * 0.1
    return tuple(t.to(DEVICE, dtype) for t in (h, norm_w, w))


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """The most units in the last place two tensors of one float dtype differ by (same signs)."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return int((a.view(ints).long() - b.view(ints).long()).abs().max().item())


@pytest.mark.quick_sample(4)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows,experts,hidden,top_k,renormalize,eps", CASES)
def test_router_with_the_norm_equals_the_norm_then_the_router(rows, experts, hidden, top_k, renormalize, eps, dtype):
    h, norm_w, w = _inputs(rows, experts, hidden, dtype, seed=rows * hidden)
    counter = new_route_counter(h.device)
    assert tr.route_linear_norm_applies(h, norm_w, w, top_k)
    h_before = h.clone()
    weights, ids, x = route_linear_norm_triton(h, norm_w, eps, w, top_k, renormalize, counter)
    assert torch.equal(h, h_before) and counter.item() == 0
    assert x.shape == h.shape and x.dtype == dtype
    # the unfused path's norm: the same roundings in the same order; on the CPU the interpreter
    # sums the statistic alike, on a GPU its two reductions may differ in order (an ulp of rstd)
    unfused = rms_norm_triton(h, norm_w, eps)
    if DEVICE == "cpu":
        assert torch.equal(x, unfused)
    else:
        assert _ulps_apart(x, unfused) <= 1
    torch.testing.assert_close(x.float().cpu(), rms_norm_ref(h.cpu(), norm_w.cpu(), eps).float(),
                               rtol=1e-5 if dtype == torch.float32 else 1.6e-2, atol=1e-6)  # bf16: 2 roundings
    # the routing: the unfused router's on the rows it wrote, bit for bit
    want_w, want_ids = route_linear_triton(x, w, top_k, renormalize, counter)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
    # and the torch chain's (the logits rounded to x's dtype, as the linear's are)
    ref_logits = F.linear(x.float(), w.float()).to(dtype).float()
    torch.testing.assert_close(torch.gather(ref_logits, 1, ids.long()).cpu(),
                               ref_logits.topk(top_k, dim=1).values.cpu())


def test_router_with_the_norm_refuses_what_it_does_not_take():
    h, norm_w, w = (t.cpu() for t in _inputs(2, 8, 32, torch.float32, seed=0))
    assert tr.route_linear_norm_applies(h, norm_w, w, 2)
    assert not tr.route_linear_norm_applies(h, norm_w.bfloat16(), w, 2)  # norm weight's dtype
    assert not tr.route_linear_norm_applies(h, norm_w[:16], w, 2)  # its width
    assert not tr.route_linear_norm_applies(torch.zeros(17, 32), norm_w, w, 2)  # past 16 rows
    with pytest.raises(ValueError, match="route_linear_norm_triton: h"):
        route_linear_norm_triton(h, norm_w.bfloat16(), 1e-6, w, 2, True, new_route_counter(h.device))


def _force_kernels(monkeypatch, fused_norm: bool) -> list[str]:
    """The block's decode-sized choices on the CPU as on a GPU: the fused router (with the norm
    when `fused_norm`) and the small path's kernels, all under the interpreter. Returns the
    log of which router ran."""
    taken: list[str] = []

    def linear_applies(x, weight, top_k):
        taken.append("linear")
        return tr.route_linear_applies(x, weight, top_k)

    def norm_applies(h, norm_weight, weight, top_k):
        ok = ops_moe.FUSED_NORM and tr.route_linear_norm_applies(h, norm_weight, weight, top_k)
        taken.append("norm" if ok else "norm apart")
        return ok

    def small(x, w_gate_up, w_down, weights, ids, residual=None, batch_invariant=False):
        assert x.shape[0] <= 4 and not batch_invariant
        return fused_moe_small(x, w_gate_up, w_down, weights, ids, residual=residual)

    monkeypatch.setattr(ops_moe, "FUSED_NORM", fused_norm)
    monkeypatch.setattr(model_moe, "route_linear_applies", linear_applies)
    monkeypatch.setattr(model_moe, "route_linear_norm_applies", norm_applies)
    monkeypatch.setattr(model_moe, "fused_moe", small)
    monkeypatch.setattr(model_moe, "rms_norm", rms_norm_triton)  # the unfused path's CUDA kernel
    return taken


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe(request, tmp_path_factory):
    from test_moe_model import make_moe_model
    folder = str(tmp_path_factory.mktemp(request.param))
    return folder, make_moe_model(request.param, folder)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_decoder_block_with_the_norm_in_the_router_equals_the_norm_apart(moe, rows, monkeypatch):
    from slipstream.model.loader import load_model
    model, _ = load_model(moe[0])
    layer = model.layers[1]
    norm_w, eps = layer.post_attention_layernorm.weight, layer.eps
    with torch.no_grad():
        norm_w.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(rows))
    h = torch.randn(rows, 64, generator=torch.Generator().manual_seed(20 + rows)) * 3
    taken = _force_kernels(monkeypatch, fused_norm=False)
    want = layer.mlp.forward_norm(h.clone(), norm_w, eps)
    assert taken == ["norm apart", "linear"]
    taken.clear()
    monkeypatch.setattr(ops_moe, "FUSED_NORM", True)
    got = layer.mlp.forward_norm(h.clone(), norm_w, eps)
    assert taken == ["norm"] and int(layer.mlp.route_counter.item()) == 0
    assert torch.equal(got, want)
    # and the torch references all through: the norm, the linear, route, the per-expert loop
    x = rms_norm_ref(h, norm_w, eps)
    weights, ids = ops_moe.route_ref(F.linear(x, layer.mlp.gate.weight), layer.mlp.top_k, layer.mlp.renormalize)
    ref = ops_moe.fused_moe_ref(x, layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj, weights, ids,
                                residual=h.clone())
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_model_logits_with_the_norm_in_the_router_match_transformers(moe, monkeypatch):
    # one-token steps after a 4-token prefill, every layer's norm inside its router's launch
    from helpers import PagedModelRunner, hf_logits

    from slipstream.model.loader import load_model
    folder, hf = moe
    model, _ = load_model(folder)
    taken = _force_kernels(monkeypatch, fused_norm=True)
    prompt = torch.randint(3, 256, (7,), generator=torch.Generator().manual_seed(3)).tolist()
    runner = PagedModelRunner(model)
    logits = [runner.step([(0, prompt[:4])])] + [runner.step([(0, [tok])]) for tok in prompt[4:]]
    assert set(taken) == {"norm"} and len(taken) == 4 * model.config.num_layers
    ref = hf_logits(hf, prompt)
    torch.testing.assert_close(torch.cat(logits), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


# --- on a GPU ---
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4])
def test_router_with_the_norm_replays_in_a_cuda_graph_on_the_qwen3_30b_shape(rows):
    # new residual rows each replay; the normalised rows and the routing those of the norm kernel
    # then the unfused router; the counter back at zero
    dev = torch.device("cuda")
    h, norm_w, w = _inputs(rows, 128, 2048, torch.bfloat16, seed=5)
    counter = new_route_counter(dev)
    outs = [torch.zeros(rows, 8, device=dev), torch.zeros(rows, 8, device=dev, dtype=torch.int32),
            torch.zeros_like(h)]

    def step():
        for out, got in zip(outs, route_linear_norm_triton(h, norm_w, 1e-6, w, 8, True, counter)):
            out.copy_(got)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(1, 5):
        h.copy_(_inputs(rows, 128, 2048, torch.bfloat16, seed)[0])
        graph.replay()
        assert _ulps_apart(outs[2], rms_norm_triton(h, norm_w, 1e-6)) <= 1
        want_w, want_ids = route_linear_triton(outs[2], w, 8, True, new_route_counter(dev))
        assert torch.equal(outs[1], want_ids) and torch.equal(outs[0], want_w)
    assert counter.item() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_moe_layer_with_the_norm_in_the_router_on_the_qwen3_30b_shape(rows):
    # the decode layer's MoE half both ways at 1-4 rows (the small path) and 8 (grouped): the
    # residual after the experts; bit for bit where the two norms' rows agree bit for bit
    from slipstream.ops.moe import fused_moe
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(rows)
    w_gate_up = (torch.randn(128, 2 * 768, 2048, device=dev, generator=g) * 0.02).bfloat16()
    w_down = (torch.randn(128, 2048, 768, device=dev, generator=g) * 0.02).bfloat16()
    h, norm_w, router = _inputs(rows, 128, 2048, torch.bfloat16, seed=30 + rows)
    counter = new_route_counter(dev)
    weights, ids, x = route_linear_norm_triton(h, norm_w, 1e-6, router, 8, True, counter)
    fused = fused_moe(x, w_gate_up, w_down, weights, ids, residual=h.clone())
    x_apart = rms_norm_triton(h, norm_w, 1e-6)
    weights_apart, ids_apart = route_linear_triton(x_apart, router, 8, True, counter)
    apart = fused_moe(x_apart, w_gate_up, w_down, weights_apart, ids_apart, residual=h.clone())
    if torch.equal(x, x_apart):
        assert torch.equal(fused, apart)
    else:  # an ulp of rstd apart: the same experts unless two logits nearly tie
        assert _ulps_apart(x, x_apart) <= 1
        same = (ids == ids_apart).all(dim=1)
        scale = apart.float().abs().max().item()
        torch.testing.assert_close(fused[same].float(), apart[same].float(), rtol=0, atol=1e-2 * scale)
