#!/usr/bin/env python
"""Can cuDNN's fused attention take a prefill step's fresh prompts (ragged lengths in one
call, GQA, causal, inside a CUDA graph), and how fast is it against slipstream's Triton
prefill kernel on the same rows?  A probe for issue 17's prefill target (>= 400 TFLOP/s):
torch's dense cuDNN SDPA measured 407-578 TFLOP/s where the Triton kernel gave 179-364
(`benchmarks/results/2026-12-01-*/prefill-long-*.log`).

    python benchmarks/probe_cudnn_varlen.py

Tries torch.ops.aten._cudnn_attention_forward with cumulative sequence offsets (the
ragged "THD" layout: q [tokens, heads, head_dim]), with the KV heads as they are (GQA) and
expanded; checks each against the Triton kernel's output (paged caches holding the same
K/V); times both in CUDA graphs; then replays one graph captured at padded sizes on other
lengths.  Prints what worked, what failed and why.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from slipstream.bench.cuda_timing import time_graph  # noqa: E402
from slipstream.ops import triton_attention as ta  # noqa: E402
from slipstream.ops.metadata import AttentionMetadata  # noqa: E402

DEV, DT, D, BS = "cuda", torch.bfloat16, 128, 16


def ragged(lens, hq, hkv, gen):
    t = sum(lens)
    q = torch.randn(t, hq, D, device=DEV, dtype=DT, generator=gen)
    k = torch.randn(t, hkv, D, device=DEV, dtype=DT, generator=gen)
    v = torch.randn(t, hkv, D, device=DEV, dtype=DT, generator=gen)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    return q, k, v, cu.to(DEV)


def paged_meta(lens, k, v):
    """Paged caches holding k/v (blocks in order) and the metadata of a fresh-prefill step."""
    blocks = [-(-n // BS) for n in lens]
    kc = torch.zeros(sum(blocks), BS, k.shape[1], D, device=DEV, dtype=DT)
    vc = torch.zeros_like(kc)
    bt = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    b = t = 0
    for r, (n, nb) in enumerate(zip(lens, blocks)):
        bt[r, :nb] = torch.arange(b, b + nb)
        kc.view(-1, k.shape[1], D)[b * BS:b * BS + n] = k[t:t + n]
        vc.view(-1, k.shape[1], D)[b * BS:b * BS + n] = v[t:t + n]
        b, t = b + nb, t + n
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(lens), 0)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    meta = AttentionMetadata(qsl.to(DEV), lens_t.to(DEV), bt.to(DEV),
                             torch.full((t,), -1, dtype=torch.int32, device=DEV), max(lens), max(lens))
    return kc, vc, meta


def cudnn_call(q, k, v, cu, max_len, scale):
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, False, 0.0, True,
                                                   False, scale=scale)[0]


def probe(lens, hq, hkv, gen):
    scale = D ** -0.5
    q, k, v, cu = ragged(lens, hq, hkv, gen)
    kc, vc, meta = paged_meta(lens, k, v)
    ref = torch.empty_like(q)
    ta.paged_attention_triton(q, kc, vc, meta, scale, out=ref)
    flops = sum(4 * D * hq * n * (n + 1) // 2 for n in lens)
    ms_triton = time_graph([lambda: ta.paged_attention_triton(q, kc, vc, meta, scale, out=ref)])
    print(f"lens {lens[:4]}{'...' if len(lens) > 4 else ''} ({len(lens)} rows, {sum(lens)} tokens), heads {hq}/{hkv}: "
          f"triton {ms_triton * 1e3:.1f} us {flops / ms_triton / 1e9:.0f} TFLOP/s", flush=True)
    group = hq // hkv
    for name, kk, vv in (("gqa", k, v), ("expanded", k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))):
        try:
            out = cudnn_call(q, kk, vv, cu, max(lens), scale)
            err = (out.float() - ref.float()).abs().max().item()
            ms = time_graph([lambda kk=kk, vv=vv: cudnn_call(q, kk, vv, cu, max(lens), scale)])
            print(f"  cudnn varlen {name}: out {tuple(out.shape)} max err vs triton {err:.2e}, {ms * 1e3:.1f} us "
                  f"{flops / ms / 1e9:.0f} TFLOP/s ({ms_triton / ms:.2f}x triton)", flush=True)
        except Exception as e:
            print(f"  cudnn varlen {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


def probe_graph_replay(hq, hkv, gen):
    """Capture at padded sizes (fixed token count and max_len), replay on other lengths."""
    scale = D ** -0.5
    cap_tokens, cap_max = 8192, 4096
    q, k, v, _ = ragged([cap_tokens], hq, hkv, gen)
    cu = torch.zeros(9, dtype=torch.int32, device=DEV)
    out = torch.empty_like(q)
    try:
        cu.copy_(torch.tensor([0, 1024, 2048, 4096, 8192, 8192, 8192, 8192, 8192], dtype=torch.int32))
        cudnn_call(q, k, v, cu, cap_max, scale)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out.copy_(cudnn_call(q, k, v, cu, cap_max, scale))
        lens = [3000, 100, 1000, 2000, 1000, 92, 500, 500]  # 8192 tokens
        cu.copy_(torch.tensor([0] + torch.cumsum(torch.tensor(lens), 0).tolist(), dtype=torch.int32))
        g.replay()
        torch.cuda.synchronize()
        kc, vc, meta = paged_meta(lens, k, v)
        ref = torch.empty_like(q)
        ta.paged_attention_triton(q, kc, vc, meta, scale, out=ref)
        err = (out.float() - ref.float()).abs().max().item()
        print(f"graph replay on new lengths {lens}: max err vs triton {err:.2e}", flush=True)
    except Exception as e:
        print(f"graph replay: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


def eager_first(gen) -> None:
    """One eager call before any graph capture in the process (a failure here is the op's own)."""
    try:
        q, k, v, cu = ragged([1500, 300, 2048], 16, 8, gen)
        out = cudnn_call(q, k, v, cu, 2048, D ** -0.5)
        torch.cuda.synchronize()
        print(f"eager cudnn varlen (GQA 16/8): out {tuple(out.shape)}", flush=True)
    except Exception as e:
        print(f"eager cudnn varlen: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)


def main() -> int:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}")
    gen = torch.Generator(device=DEV).manual_seed(0)
    eager_first(gen)
    for hq, hkv in ((32, 8), (16, 8)):
        for lens in ([2048] * 8, [4096] * 2, [16384], [1500, 300, 2048, 700, 17, 1200, 900, 1427]):
            probe(lens, hq, hkv, gen)
        probe_graph_replay(hq, hkv, gen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
