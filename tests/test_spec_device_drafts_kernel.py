"""Device drafting's two Triton kernels (ops/triton_device_drafts.py, under TRITON_INTERPRET=1
on the CPU) against the torch reference (`runner.spec_device.shift_and_draft_ref`), with n-gram
drafts and with a device drafter's buffered ones: on random steps of mixed rows (verifying rows of k + 1 tokens, plain decode rows, a prompt chunk; rows
shifted by the previous step's emitted counts or not; carried first tokens; slot-mapping
entries that store nothing), every input they correct, the token history and the drafts are
equal exactly, and so are the drafts and counts written into the padded step's verify inputs;
with small loop blocks, so that rows and histories span several (the earliest
occurrence of the longest n-gram may sit in any block)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from slipstream.ops.triton_device_drafts import shift_and_draft_triton
from slipstream.runner.spec_device import DeviceDraftInputs, shift_and_draft_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _step(seed: int, k: int, L: int = 48, bs: int = 4, max_seqs: int = 6):
    """A random step: the slot's device inputs, the previous slot's tokens and emitted counts,
    the history and the DeviceDraftInputs (what `prepare_device_drafts` gets)."""
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, max_seqs + 1))
    kinds = rng.choice(["verify", "decode", "chunk"], B, p=[0.5, 0.3, 0.2])
    n = np.array([k + 1 if kd == "verify" else 1 if kd == "decode" else int(rng.integers(2, 7)) for kd in kinds])
    start = rng.integers(0, L - 2 * k - 8, B)
    qsl = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
    T = int(qsl[-1])
    max_blocks = -(-L // bs)
    table_rows = rng.permutation(max_seqs + 1)[:B]
    block_table = rng.permutation(max_seqs * max_blocks).reshape(max_seqs, max_blocks).astype(np.int32)
    seq = np.repeat(np.arange(B), n)
    pos = np.arange(T) - qsl[seq] + start[seq]
    slot_mapping = block_table[seq, pos // bs] * bs + pos % bs
    slot_mapping[rng.random(T) < 0.15] = -1  # tokens that store nothing
    carry = np.full(T, -1)
    carried = rng.random(B) < 0.6
    carry[qsl[:-1][carried]] = rng.integers(0, max_seqs, int(carried.sum()))
    vocab = 5
    hist = rng.integers(0, vocab, (max_seqs + 1, L))
    for r in range(0, max_seqs + 1, 2):  # periodic rows: long matches
        period = int(rng.integers(1, 5))
        hist[r] = np.resize(hist[r, :period], L)
    sample_seq = np.flatnonzero(kinds != "chunk") if rng.random() < 0.5 else np.arange(B)
    S = len(sample_seq)
    vseq = np.flatnonzero(kinds == "verify")

    def i32(a):
        return torch.tensor(np.asarray(a), dtype=torch.int32, device=DEVICE)

    def i64(a):
        return torch.tensor(np.asarray(a), dtype=torch.int64, device=DEVICE)

    pad = 5  # device buffers are longer than the step
    d = SimpleNamespace(
        positions=i32(np.concatenate([pos, np.zeros(pad)])), seq_lens=i32(np.concatenate([start + n, np.zeros(pad)])),
        slot_mapping=i32(np.concatenate([slot_mapping, np.full(pad, -1)])), block_table=i32(block_table),
        input_ids=i32(np.concatenate([rng.integers(0, vocab, T), np.zeros(pad)])),
        carry_idx=i32(np.concatenate([carry, np.full(pad, -1)])),
        token_index=i32(np.concatenate([rng.integers(0, 50, S), np.zeros(pad)])),
        query_start_loc=i32(np.concatenate([qsl, np.zeros(pad)])))
    prev_tokens = i32(rng.integers(0, vocab, max_seqs))
    prev_emitted = i32(rng.integers(1, k + 2, max_seqs))
    shift = np.where(rng.random(B) < 0.6, rng.integers(0, max_seqs, B), -1)
    inp = DeviceDraftInputs(i64(shift), i64(seq), i64(table_rows), i64(sample_seq), i64(qsl[vseq]),
                            i64(table_rows[vseq]))
    return d, prev_tokens, prev_emitted, i32(hist), inp, T, bs


def _clone(d):
    return SimpleNamespace(**{name: t.clone() for name, t in vars(d).items()})


def _buffered_drafter(d, prev_tokens, emitted, hist, inp, T, bs, k, seed):
    """A device drafter (runner/device_drafter.py's buffers) whose rows hold random drafts,
    made for the verifying row's position (about 60% of rows) or for another one."""
    from slipstream.runner.device_drafter import DeviceDrafter
    drafter = DeviceDrafter(hist.shape[0], hist.shape[1], bs, torch.device(DEVICE), k, 5)
    g = torch.Generator().manual_seed(seed)
    drafter.drafts.copy_(torch.randint(0, 5, drafter.drafts.shape, generator=g))
    probe = _clone(d)  # where the shift puts each verifying row's first input
    shift_and_draft_ref(probe, prev_tokens, hist.clone(), inp, emitted, T, bs, k, 1, 1)
    p0 = probe.positions.long().index_select(0, inp.first_token)
    made_here = torch.rand(p0.shape, generator=g).to(DEVICE) < 0.6
    drafter.next_pos.index_copy_(0, inp.verify_table_rows, torch.where(made_here, p0 + 1, p0 + 3))
    return drafter


@pytest.mark.slow
@pytest.mark.parametrize("k, min_n, max_n", [(1, 1, 1), (3, 1, 3), (4, 2, 4), (2, 2, 2), (5, 1, 4)])
@pytest.mark.parametrize("synthetic", [False, True])
@pytest.mark.parametrize("buffered", [False, True])
def test_the_kernels_equal_the_torch_reference(k, min_n, max_n, synthetic, buffered):
    """n-gram drafts, or (`buffered`) a device drafter's buffered drafts."""
    drafted = verified = 0
    for seed in range(16):
        d, prev_tokens, emitted, hist, inp, T, bs = _step(seed * 7 + k, k)
        drafter = _buffered_drafter(d, prev_tokens, emitted, hist, inp, T, bs, k, seed) if buffered else None
        d_ref, h_ref = _clone(d), hist.clone()
        want = shift_and_draft_ref(d_ref, prev_tokens, h_ref, inp, emitted, T, bs, k, min_n, max_n, synthetic,
                                   drafter)
        # the padded step's static verify inputs: each verifying row's drafts, then its count, at its row
        R = inp.first_token.shape[0]
        dst = torch.randint(0, 9, (8, k + 2), dtype=torch.int32, device=DEVICE)
        rows = torch.randperm(8, device=DEVICE)[:R]
        dst_ref = dst.clone()
        got = shift_and_draft_triton(d.positions, d.seq_lens, d.slot_mapping, d.block_table, d.input_ids,
                                     d.carry_idx, d.token_index, d.query_start_loc, prev_tokens, emitted, hist,
                                     inp.shift_src, inp.sample_seq, inp.table_rows, inp.first_token,
                                     inp.verify_table_rows, bs, k, min_n, max_n, synthetic, into=(dst, rows),
                                     buffered=None if drafter is None else (drafter.drafts, drafter.next_pos),
                                     block=4, ngram_block=8)
        dst_ref[:, :k].index_copy_(0, rows, want[0].to(torch.int32))
        dst_ref[:, k].index_copy_(0, rows, want[1].to(torch.int32))
        assert torch.equal(dst, dst_ref), seed
        for name in vars(d):
            assert torch.equal(getattr(d, name), getattr(d_ref, name)), (seed, name)
        assert torch.equal(hist, h_ref), seed
        assert torch.equal(got[0], want[0].to(torch.int32)) and torch.equal(got[1], want[1].to(torch.int32)), \
            (seed, got, want)
        drafted += int((want[1] > 0).sum())
        verified += len(want[1])
    assert verified > 20 and drafted >= verified // 4  # not vacuous: many rows draft


@pytest.mark.slow  # two engines under the interpreter: ~5 s
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run on the CPU; a GPU's engine takes "
                    "the kernels itself (tests/test_gpu_spec.py)")
def test_an_async_ngram_engine_on_the_kernels_equals_plain_decoding(tiny_model, monkeypatch):
    """The engine's device drafting through the kernels (the interpreter's, on the CPU): the
    greedy tokens of decoding without speculation, for four rows and for one, unpadded and
    in the padded verify layout, drafts accepted, the kernels run every speculative step."""
    from slipstream import LLM, SamplingParams
    from slipstream.ops import triton_device_drafts
    from slipstream.runner import spec_device
    from slipstream.runner.graphs import StepGraphs, capture_sizes

    calls = []
    kernel = triton_device_drafts.shift_and_draft_triton

    def spy(*a, **kw):
        calls.append(a[14].shape[0])  # (the verifying rows)
        return kernel(*a, **kw)

    monkeypatch.setattr(spec_device, "triton_drafting", lambda d: True)
    monkeypatch.setattr(triton_device_drafts, "shift_and_draft_triton", spy)
    folder, _ = tiny_model("llama")
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    prompts = [[5, 6, 7, 8, 9, 10] * 4, [40, 41, 42] * 7 + [40], [3, 1, 4, 1, 5, 9, 2, 6] * 3, [100, 101, 102, 103]]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for batch, padded in ((prompts, False), (prompts[1:2], False), (prompts, True)):
        plain = [o.outputs[0].token_ids for o in LLM(folder, device="cpu", max_model_len=256).generate(batch, params)]
        llm = LLM(folder, device="cpu", max_model_len=256, speculative_config=ngram, async_scheduling=True)
        if padded:  # the GPU's padded verify layout (nothing captured: run eagerly)
            runner = llm.engine.runner
            runner.graphs = StepGraphs(capture_sizes(8), [], 8, runner.max_model_len)
        calls.clear()
        assert [o.outputs[0].token_ids for o in llm.generate(batch, params)] == plain
        assert len(calls) >= 5 and any(calls), calls
        assert llm.engine.stats()["spec_num_accepted_tokens"] > 0


@pytest.mark.slow  # two engines under the interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run on the CPU; a GPU's engine takes "
                    "the kernels itself (tests/test_gpu_spec_drafters.py)")
def test_an_async_eagle3_engine_on_the_kernels_equals_plain_decoding(tiny_model, tmp_path, monkeypatch):
    """A device drafter's drafts placed by the kernels (an EAGLE-3 random head, async): the
    greedy tokens of decoding without speculation, the kernels run with the buffered drafts."""
    import json

    from test_spec_eagle3_engine import _head_config

    from slipstream import LLM, SamplingParams
    from slipstream.ops import triton_device_drafts
    from slipstream.runner import spec_device

    calls = []
    kernel = triton_device_drafts.shift_and_draft_triton

    def spy(*a, **kw):
        calls.append(kw.get("buffered", a[22] if len(a) > 22 else None) is not None)
        return kernel(*a, **kw)

    monkeypatch.setattr(spec_device, "triton_drafting", lambda d: True)
    monkeypatch.setattr(triton_device_drafts, "shift_and_draft_triton", spy)
    folder, _ = tiny_model("llama")
    head = tmp_path / "head.json"
    head.write_text(json.dumps(_head_config(200, 2)))
    eagle = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    prompts = [[5, 6, 7, 8, 9, 10] * 3, [40, 41, 42] * 5, [100, 101, 102, 103]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(folder, device="cpu", max_model_len=256).generate(prompts, params)]
    llm = LLM(folder, device="cpu", max_model_len=256, speculative_config=eagle, async_scheduling=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    assert len(calls) >= 5 and all(calls), calls


def compile_for_hopper() -> None:
    """Both kernels as `shift_and_draft_triton` launches them, compiled for sm_90 (the
    interpreter runs what a compiler may refuse: loop-carried scalars, runtime loop bounds)."""
    from helpers import compile_pdl_launches_for_hopper
    from test_attention_kernels import recorded_launches

    import slipstream.ops.triton_device_drafts as m
    launches: list = []
    d, prev_tokens, emitted, hist, inp, T, bs = _step(3, 4)
    with recorded_launches(m, ["_shift_kernel", "_ngram_kernel"], launches):
        m.shift_and_draft_triton(d.positions, d.seq_lens, d.slot_mapping, d.block_table, d.input_ids, d.carry_idx,
                                 d.token_index, d.query_start_loc, prev_tokens, emitted, hist, inp.shift_src,
                                 inp.sample_seq, inp.table_rows, inp.first_token, inp.verify_table_rows, bs, 4, 2, 4,
                                 into=(torch.zeros(8, 6, dtype=torch.int32), torch.arange(inp.first_token.shape[0])))
        drafter = _buffered_drafter(d, prev_tokens, emitted, hist, inp, T, bs, 4, 3)
        m.shift_and_draft_triton(d.positions, d.seq_lens, d.slot_mapping, d.block_table, d.input_ids, d.carry_idx,
                                 d.token_index, d.query_start_loc, prev_tokens, emitted, hist, inp.shift_src,
                                 inp.sample_seq, inp.table_rows, inp.first_token, inp.verify_table_rows, bs, 4, 2, 4,
                                 buffered=(drafter.drafts, drafter.next_pos))
    assert len(launches) == 4
    compile_pdl_launches_for_hopper(launches)


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels run compiled")
def test_the_kernels_compile_for_hopper():
    from helpers import run_hopper_compile
    out = run_hopper_compile(__file__)
    assert [ln for ln in out.splitlines() if ln.startswith("compiled")] == \
        ["compiled _shift_kernel", "compiled _ngram_kernel"] * 2, out


if __name__ == "__main__":
    import sys
    if "--compile-for-hopper" in sys.argv:
        compile_for_hopper()
