"""The small-batch MoE path (`ops/triton_moe_small.py`: two GEMV launches that read the router's
ids directly) under TRITON_INTERPRET=1 on the CPU (on CUDA tensors where a GPU exists) against
the per-expert loop, `fused_moe_ref`: the routing weights applied (renormalised or not, and
arbitrary ones), tied router probabilities, an expert chosen by several tokens, sizes that are
not powers of two, bf16 with the residual stream, only the routed experts' weights read, and a
token's result independent of the other tokens of the step (bit for bit). `fused_moe`'s choice
between it and the grouped GEMMs, batch-invariant mode included. On a GPU: replay in a CUDA
graph on new routings, agreement with the grouped path on the Qwen3-30B-A3B shape, and
batch-invariant mode's one result a token at every step size."""
from __future__ import annotations

import sys

import pytest
import torch
from test_attention_kernels import DEVICE, tolerances

import slipstream.ops.moe as ops_moe
from slipstream.ops.moe import fused_moe_ref, moe_path, route
from slipstream.ops.triton_moe_small import SmallMoEConfig, fused_moe_small

HIDDEN, INTER = 64, 32
# tiles smaller than the sizes: several programs a row, several loop steps a program
SMALL = SmallMoEConfig(up_block_n=8, up_block_k=16, down_block_n=16, down_block_k=8, num_warps=1, num_stages=2)
F32_TOL = (dict(rtol=1e-5, atol=1e-5) if DEVICE == "cpu"
           else dict(zip(("atol", "rtol"), tolerances(torch.float32))))


def _dev(*tensors: torch.Tensor):
    return tuple(t.to(DEVICE) for t in tensors)


def _weights(num_experts: int, hidden: int = HIDDEN, inter: int = INTER, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w_gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2).to(dtype)
    w_down = (torch.randn(num_experts, hidden, inter, generator=g) * 0.2).to(dtype)
    return w_gate_up, w_down


def _logits(num_tokens: int, num_experts: int, seed: int, only: list[int] | None = None) -> torch.Tensor:
    """Router logits; `only`: every other expert's logit -inf (so those experts get no token)."""
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed))
    if only is not None:
        keep = torch.full((num_experts,), float("-inf"))
        keep[only] = 0.0
        logits = logits + keep
    return logits


def _check(x, w_gate_up, w_down, weights, ids, cfg=SMALL, **tol):
    ref = fused_moe_ref(x, w_gate_up, w_down, weights, ids)
    out = fused_moe_small(*_dev(x, w_gate_up, w_down, weights, ids), cfg)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.cpu(), ref, **(tol or F32_TOL))
    return out


# (tokens, experts, top_k, renormalize, experts that get tokens (None: any))
CASES = {
    "decode row": (1, 8, 2, True, None),
    "Qwen3-like k of 8, not renormalised": (2, 16, 8, False, None),
    "an expert chosen by every token": (4, 8, 2, True, [3, 5]),
    "three tokens on three experts, k 3": (3, 6, 3, False, [0, 2, 5]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_small_path_equals_the_per_expert_loop(case):
    num_tokens, num_experts, top_k, renormalize, only = CASES[case]
    w_gate_up, w_down = _weights(num_experts)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(3))
    weights, ids = route(_logits(num_tokens, num_experts, 4, only), top_k, renormalize)
    if only is not None:  # each of these experts is some token's, several tokens' when k = |only|
        assert sorted(ids.unique().tolist()) == sorted(only)
    _check(x, w_gate_up, w_down, weights, ids)


@pytest.mark.slow
def test_the_routing_weights_scale_each_slot():
    # arbitrary weights (not a softmax, not summing to 1, one of them 0): each slot's output is
    # scaled by its own weight, a zero weight removes the slot
    w_gate_up, w_down = _weights(8)
    x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(5))
    ids = torch.tensor([[6, 1, 3], [1, 0, 7]], dtype=torch.int32)
    weights = torch.tensor([[2.0, 0.0, -0.5], [0.25, 1.5, 3.0]])
    out = _check(x, w_gate_up, w_down, weights, ids)
    # the slot of weight 0 removed: the same result as the token without it
    alone = fused_moe_small(*_dev(x[:1], w_gate_up, w_down, weights[:1, [0, 2]], ids[:1, [0, 2]]), SMALL)
    torch.testing.assert_close(out[:1].cpu(), alone.cpu(), **F32_TOL)


@pytest.mark.slow
def test_tied_router_probabilities():
    # a row of equal logits: k experts of equal weight (1/k each once renormalised), the ids
    # route chose (ties to the lower id on the kernel, any on the CPU): the layer follows the ids
    w_gate_up, w_down = _weights(8)
    x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(6))
    logits = torch.zeros(2, 8)
    logits[1, [2, 6]] = 1.0  # two tied at the top, the rest tied below
    weights, ids = route(logits, 4, True)
    assert torch.all(weights[0] == 0.25)
    assert set(ids[1, :2].tolist()) == {2, 6} and weights[1, 0] == weights[1, 1]
    _check(x, w_gate_up, w_down, weights, ids)


@pytest.mark.slow
def test_sizes_that_are_not_powers_of_two():
    w_gate_up, w_down = _weights(5, hidden=40, inter=24)
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(7))
    weights, ids = route(_logits(3, 5, 8), 2, True)
    _check(x, w_gate_up, w_down, weights, ids)
    _check(x, w_gate_up, w_down, weights, ids, SmallMoEConfig())  # the default tiles, clipped


@pytest.mark.slow
def test_bf16_adds_into_the_residual_stream_with_one_rounding():
    w_gate_up, w_down = _weights(8, dtype=torch.bfloat16)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    h = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    weights, ids = route(_logits(3, 8, 11), 2, True)
    ref_h, (tri_h,) = h.clone(), _dev(h.clone())
    fused_moe_ref(x, w_gate_up, w_down, weights, ids, residual=ref_h)
    got = fused_moe_small(*_dev(x, w_gate_up, w_down, weights, ids), SMALL, residual=tri_h)
    assert got is tri_h and got.dtype == torch.bfloat16
    scale = ref_h.float().abs().max().item()  # a few bf16 steps of the largest value
    torch.testing.assert_close(tri_h.cpu().float(), ref_h.float(), rtol=0, atol=2e-2 * scale)


def test_only_the_routed_experts_weights_are_read():
    # the idle experts' weights are NaN: any read of them would reach the output
    w_gate_up, w_down = _weights(8)
    weights, ids = route(_logits(2, 8, 12, only=[1, 4, 6]), 2, True)
    idle = [e for e in range(8) if e not in ids.unique().tolist()]
    w_gate_up[idle] = float("nan")
    w_down[idle] = float("nan")
    x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(13))
    out = _check(x, w_gate_up, w_down, weights, ids)
    assert torch.isfinite(out).all()


@pytest.mark.slow  # six interpreted launches; the quick tier keeps the values checks
def test_a_tokens_result_does_not_depend_on_the_other_tokens():
    # the k slots summed in a fixed order inside one program: bit for bit the same alone, in a
    # batch of four, and on a second call
    w_gate_up, w_down = _weights(8, dtype=torch.bfloat16)
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
    weights, ids = route(_logits(4, 8, 15), 3, True)
    args = _dev(x, w_gate_up, w_down, weights, ids)
    batch = fused_moe_small(*args, SMALL)
    assert torch.equal(fused_moe_small(*args, SMALL), batch)
    for t in range(4):
        alone = fused_moe_small(args[0][t:t + 1], args[1], args[2], args[3][t:t + 1], args[4][t:t + 1], SMALL)
        assert torch.equal(alone[0], batch[t])


def test_bad_tiles_and_shapes_are_refused():
    with pytest.raises(ValueError, match="up_block_n must be a power of two"):
        SmallMoEConfig(up_block_n=12)
    with pytest.raises(ValueError, match="num_stages"):
        SmallMoEConfig(num_stages=0)
    w_gate_up, w_down = _weights(4)
    with pytest.raises(ValueError, match="do not agree"):
        fused_moe_small(torch.zeros(1, HIDDEN + 1), w_gate_up, w_down, torch.ones(1, 2),
                        torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="for 2 tokens"):
        fused_moe_small(torch.zeros(2, HIDDEN), w_gate_up, w_down, torch.ones(1, 2),
                        torch.zeros(1, 2, dtype=torch.int32))


def test_moe_path_by_step_size_and_batch_invariance(monkeypatch):
    monkeypatch.setattr(ops_moe, "SMALL_MOE_TOKENS", 4)
    assert [moe_path(t) for t in (1, 4, 5, 256)] == ["small", "small", "grouped", "grouped"]
    # batch-invariant mode: one path (and one tile) at every size
    assert {moe_path(t, batch_invariant=True) for t in (1, 4, 5, 256)} == {"grouped"}
    monkeypatch.setattr(ops_moe, "SMALL_MOE_TOKENS", 0)  # off: A/B runs
    assert moe_path(1) == "grouped"


def test_batch_invariant_moe_block_passes_the_mode_to_fused_moe(tmp_path, monkeypatch):
    # set_batch_invariant reaches each MoE block, which hands it to fused_moe
    from test_moe_model import make_moe_model

    import slipstream.model.moe as model_moe
    from slipstream.model.loader import load_model

    make_moe_model("qwen3_moe", str(tmp_path))
    model, _ = load_model(str(tmp_path))
    seen = []

    def spy(*args, batch_invariant=False, **kw):
        seen.append(batch_invariant)
        return fused_moe_ref(*args, **kw)

    monkeypatch.setattr(model_moe, "fused_moe", spy)
    block = model.layers[0].mlp
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(16))
    block(torch.zeros(2, 64), x)
    model.set_batch_invariant(True)
    block(torch.zeros(2, 64), x)
    assert seen == [False, True]


# --- on a GPU ---
@pytest.mark.gpu
def test_small_path_replays_in_a_cuda_graph_with_new_routing():
    # captured once per size, replayed on other tokens and routings (no host sync, fixed buffers)
    dev = torch.device("cuda")
    w_gate_up, w_down = (w.to(dev, torch.bfloat16) for w in _weights(16))
    for rows in (1, 4):
        x = torch.zeros(rows, HIDDEN, device=dev, dtype=torch.bfloat16)
        logits = torch.zeros(rows, 16, device=dev)
        h = torch.zeros(rows, HIDDEN, device=dev, dtype=torch.bfloat16)
        out = torch.zeros_like(h)

        def step():
            weights, ids = route(logits, 4, renormalize=True)
            out.copy_(fused_moe_small(x, w_gate_up, w_down, weights, ids, residual=h.clone()))

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # compiles
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for seed, only in ((1, None), (2, [3, 5, 7, 9]), (3, [0, 15])):
            g = torch.Generator().manual_seed(seed)
            x.copy_(torch.randn(rows, HIDDEN, generator=g))
            h.copy_(torch.randn(rows, HIDDEN, generator=g))
            logits.copy_(_logits(rows, 16, seed, only))
            graph.replay()
            weights, ids = route(logits, 4, renormalize=True)
            ref = fused_moe_ref(x, w_gate_up, w_down, weights, ids, residual=h.clone())
            torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_small_path_agrees_with_the_grouped_path_on_the_qwen3_30b_shape(rows):
    from slipstream.ops.triton_moe import fused_moe_triton
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(rows)
    w_gate_up = (torch.randn(128, 2 * 768, 2048, device=dev, generator=g) * 0.02).bfloat16()
    w_down = (torch.randn(128, 2048, 768, device=dev, generator=g) * 0.02).bfloat16()
    x = torch.randn(rows, 2048, device=dev, generator=g).bfloat16()
    weights, ids = route(torch.randn(rows, 128, device=dev, generator=g), 8, True)
    small = fused_moe_small(x, w_gate_up, w_down, weights, ids).float()
    grouped = fused_moe_triton(x, w_gate_up, w_down, weights, ids).float()
    ref = fused_moe_ref(x, w_gate_up, w_down, weights, ids).float()
    scale = ref.abs().max().item()
    torch.testing.assert_close(small, ref, rtol=0, atol=1e-2 * scale)
    torch.testing.assert_close(small, grouped, rtol=0, atol=1e-2 * scale)


@pytest.mark.gpu
def test_batch_invariant_fused_moe_gives_a_token_one_result_at_every_step_size():
    # the grouped GEMMs with one tile at every size: a token alone (where the small path would
    # run) and among 3 and 100 others, bit for bit; off, the one-token step takes the small path
    from slipstream.ops.moe import fused_moe
    dev = torch.device("cuda")
    w_gate_up, w_down = (w.to(dev, torch.bfloat16) for w in _weights(16))
    x = torch.randn(101, HIDDEN, generator=torch.Generator().manual_seed(17)).to(dev, torch.bfloat16)
    weights, ids = route(_logits(101, 16, 18).to(dev), 4, True)
    outs = [fused_moe(x[:n], w_gate_up, w_down, weights[:n], ids[:n], batch_invariant=True)[0]
            for n in (1, 4, 101)]
    assert all(torch.equal(o, outs[0]) for o in outs)
    small = fused_moe(x[:1], w_gate_up, w_down, weights[:1], ids[:1])
    assert torch.equal(small, fused_moe_small(x[:1], w_gate_up, w_down, weights[:1], ids[:1]))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_engine_on_a_gpu_equals_the_cpu_engine_at_small_and_grouped_steps(kind, tmp_path):
    # fp32, token for token: one request (one-row decode steps: the small path in the decode
    # graphs), three (padded to 4: small) and seven (8: grouped), sync and async
    from test_moe_model import make_moe_model

    from slipstream import LLM, SamplingParams
    make_moe_model(kind, str(tmp_path))
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(19)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 23, 9, 40, 3, 17, 11)]
    batches = ([prompts[0]], prompts[:3], prompts)
    cpu = LLM(str(tmp_path), device="cpu", max_model_len=256)
    refs = [[o.token_ids for o in cpu.generate(batch, params)] for batch in batches]
    for async_scheduling in (False, True):
        gpu = LLM(str(tmp_path), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8,
                  async_scheduling=async_scheduling)
        for batch, ref in zip(batches, refs):
            assert [o.token_ids for o in gpu.generate(batch, params)] == ref, (len(batch), async_scheduling)
        assert sum(gpu.engine.runner.graph_replays["decode"]) > 0
        del gpu
        torch.cuda.empty_cache()


# --- compiled for Hopper without a GPU (the interpreter misses what only the compiler rejects) ---
HOPPER_CONFIGS = [SmallMoEConfig(), SmallMoEConfig(32, 128, 16, 256, 4, 4), SmallMoEConfig(8, 256, 4, 512, 4, 5),
                  SmallMoEConfig(16, 256, 8, 128, 8, 2)]


def compile_small_moe_for_hopper() -> None:
    """The two kernels compiled for sm_90 as the host code launches them: the Qwen3-30B-A3B
    shape at one token (each of HOPPER_CONFIGS) and Mixtral's (k 2, I 14336) at 4, bf16 with
    the residual. Prints each one's registers and local memory (spills)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import kernel_resources as kr
    from test_attention_kernels import compile_launch_for_hopper, recorded_launches

    import slipstream.ops.triton_moe_small as tms
    launches: list = []
    bf = torch.bfloat16
    shapes = [(1, 128, 8, 2048, 768, c) for c in HOPPER_CONFIGS] + [(4, 8, 2, 4096, 14336, SmallMoEConfig())]
    with recorded_launches(tms, ["_small_gate_up_kernel", "_small_down_kernel"], launches):
        for t, e, k, h, i, cfg in shapes:
            x = torch.zeros(t, h, dtype=bf)
            ids = torch.zeros(t, k, dtype=torch.int32)
            tms.fused_moe_small(x, torch.zeros(e, 2 * i, h, dtype=bf), torch.zeros(e, h, i, dtype=bf),
                                torch.zeros(t, k), ids, cfg, residual=torch.zeros(t, h, dtype=bf))
    for fn, args, kw in launches:
        compiled, _, opts = compile_launch_for_hopper(fn, args, kw)
        res = kr.resources(compiled.asm["cubin"])
        print("compiled", fn.__name__, opts["num_warps"], "warps", res)
        assert res["local"] == 0, f"{fn.__name__} spills: {res}"


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the GPU tests compile the kernels")
def test_small_moe_kernels_compile_for_hopper():
    from helpers import run_hopper_compile
    out = run_hopper_compile(__file__)
    assert out.count("compiled") == 2 * (len(HOPPER_CONFIGS) + 1), out


if __name__ == "__main__":
    if "--compile-for-hopper" in sys.argv:
        compile_small_moe_for_hopper()
