"""On the GPU: n-gram drafting and rejection sampling run inside a CUDA graph (no host sync)
and give the CPU reference's results (the sampler's Triton kernel draws the tokens); the
EAGLE-3 head in bf16 over the Triton attention kernels agrees with its float32 CPU run."""
from __future__ import annotations

import pytest
import torch

from slipstream.spec.ngram import propose_ngram_device
from slipstream.spec.rejection import rejection_sample

pytestmark = pytest.mark.gpu


def _capture(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up (Triton compiles here)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def test_ngram_drafting_in_a_cuda_graph_equals_the_cpu():
    g = torch.Generator().manual_seed(0)
    R, L = 64, 512
    history = torch.randint(0, 5, (R, L), generator=g, dtype=torch.int32)
    lengths = torch.randint(2, L + 1, (R,), generator=g, dtype=torch.int32)
    want = propose_ngram_device(history, lengths, 4, 1, 3)
    h, n = history.cuda(), lengths.cuda()
    graph, (drafts, num) = _capture(lambda: propose_ngram_device(h, n, 4, 1, 3))
    graph.replay()
    assert torch.equal(drafts.cpu(), want[0]) and torch.equal(num.cpu(), want[1])


@pytest.mark.parametrize("with_probs", [False, True])
def test_rejection_sampling_in_a_cuda_graph_equals_the_cpu(with_probs):
    g = torch.Generator().manual_seed(1)
    R, k, V = 32, 4, 1000
    logits = torch.randn(R, k + 1, V, generator=g) * 3
    logits[:, :, 500:] = float("-inf")  # a top-k style cut, as processed_logits leaves it
    drafts = logits[:, :k].argmax(-1)
    drafts[::3, 1] = 7
    num = torch.full((R,), k)
    probs = torch.softmax(torch.randn(R, k, V, generator=g), -1) if with_probs else None
    greedy = torch.arange(R) % 4 == 0
    seed, index = torch.arange(R) * 13, torch.zeros(R, dtype=torch.int32)
    want = rejection_sample(logits, drafts, num, probs, greedy, seed, index)
    args = [x.cuda() if x is not None else None for x in (logits, drafts, num, probs, greedy, seed, index)]
    graph, got = _capture(lambda: rejection_sample(*args))
    graph.replay()
    # Triton and torch agree up to the ulp of log: a near tie could differ, not at these sizes
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_the_eagle3_head_on_the_gpu_equals_the_cpu(tmp_path):
    from test_spec_eagle3 import HD, HT, NKV, _checkpoint, _meta, _write

    from slipstream.model.eagle3_loader import load_eagle3

    _write(tmp_path, _checkpoint(torch.Generator().manual_seed(2), True), True)
    outs = []
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        head = load_eagle3(str(tmp_path), dtype=dtype, device=device)
        kv = (torch.zeros(16, 4, NKV, HD, device=device, dtype=dtype),
              torch.zeros(16, 4, NKV, HD, device=device, dtype=dtype))
        g = torch.Generator().manual_seed(4)
        ids, aux = torch.randint(0, 50, (12,), generator=g), torch.randn(12, 3 * HT, generator=g)
        meta, pos = _meta([7, 5], [0, 0])
        meta = type(meta)(*(t.to(device) for t in (meta.query_start_loc, meta.seq_lens, meta.block_table,
                                                    meta.slot_mapping)), meta.max_query_len, meta.max_seq_len)
        normed, _ = head(ids.to(device, torch.int32), pos.to(device, torch.int32),
                         head.combine_hidden_states(aux.to(device, dtype)), meta, kv)
        outs.append(head.target_logits(normed).float().cpu())
    # bf16 on the GPU against float32 on the CPU (the unmapped ids are -inf in both)
    torch.testing.assert_close(outs[1], outs[0], rtol=5e-2, atol=5e-2)
