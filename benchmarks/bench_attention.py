#!/usr/bin/env python
"""Benchmark of slipstream's Triton paged-attention kernels on one CUDA GPU.

    python benchmarks/bench_attention.py [--out DIR] [--decode NAME:k=v,...] [--prefill NAME:k=v,...]

1. Device copy bandwidth: a 1 GiB device-to-device copy, bytes read + written.
2. Decode attention on the Llama-3.1-8B shape (32 q heads, 8 KV heads, head_dim 128, bf16,
   block_size 16, block tables in random order) at batch x context 32 x 8192, 32 x 4096 and
   256 x 1024, for each decode variant (DecodeConfig tunables).  Achieved bytes/s counts
   K + V read plus q read and out written; "%copy" is that over the copy bandwidth.
3. Prefill: 8 fresh prompts of 2048 tokens (causal), for each prefill variant; TFLOP/s
   counts 4 * head_dim * num_heads * (causal query-key pairs).
4. One mixed batch (a 2048-token prompt + 31 decodes at 4096) with the defaults.
5. One CUDA-graph check: decode captured with max_seq_len = 131072, replayed on short rows.

--smoke runs the same code on the CPU under Triton's interpreter at tiny sizes (no graphs,
meaningless timings): a check of the script itself.

Timing: each call is captured in a CUDA graph together with the same call on the other
(rotating) KV caches, so neither launch gaps nor L2 reuse flatter the result; the median
of 20 replays is divided by the number of rotations.  Every variant is first checked
against the pure-torch reference (eager).  Takes well under two minutes.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402

from slipstream.bench import cuda_timing  # noqa: E402
from slipstream.bench.report import write_json  # noqa: E402
from slipstream.ops import triton_attention as ta  # noqa: E402
from slipstream.ops.attention import paged_attention_ref  # noqa: E402
from slipstream.ops.metadata import AttentionMetadata  # noqa: E402
from slipstream.utils.overrides import parse_variant  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
SCALE = HEAD_DIM ** -0.5
ROTATIONS = 3
ITERS = 20

DECODE_VARIANTS: dict[str, ta.DecodeConfig] = {
    "default": ta.DecodeConfig(),
    "reduce": ta.DecodeConfig(fused_merge=False),  # splits merged by a second kernel
    "v3": ta.DecodeConfig(ctas_per_sm=16, longest_first=False, fused_merge=False),  # before v4
    "nosplit": ta.DecodeConfig(num_splits=1),
    # forced split counts with larger minimum chunks (a row of L tokens runs
    # min(S, cdiv(L, chunk)) programs): s{S}c{min_chunk}
    "s2c512": ta.DecodeConfig(num_splits=2, min_chunk=512),
    "s4c256": ta.DecodeConfig(num_splits=4),
    "s4c512": ta.DecodeConfig(num_splits=4, min_chunk=512),
    "s4c1024": ta.DecodeConfig(num_splits=4, min_chunk=1024),
    "s8c512": ta.DecodeConfig(num_splits=8, min_chunk=512),
    "s8c1024": ta.DecodeConfig(num_splits=8, min_chunk=1024),
    "n128s2": ta.DecodeConfig(block_n=128, num_stages=2, large_batch=1 << 30),  # every batch size
}
PREFILL_VARIANTS: dict[str, ta.PrefillConfig] = {
    "default": ta.PrefillConfig(),
    "m128n64w8": ta.PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=2),
    "m128n32w4s2": ta.PrefillConfig(block_m=128, block_n=32, num_warps=4, num_stages=2),
    "m64n32w4": ta.PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=3),
    "m128n64w4": ta.PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3),
}
DECODE_CASES = [(32, 8192), (32, 4096), (32, 2048), (32, 1024), (256, 1024)]
# ragged rows (small-256-like: contexts spread over 100..2000), label -> (batch, lo, hi)
RAGGED_CASES = {"256xU(100,2000)": (256, 100, 2000), "64xU(100,2000)": (64, 100, 2000)}
PREFILL_CASE = (8, 2048)
MIXED_CASE = ([2048] + [4096] * 31, [2048] + [1] * 31)
DEVICE = "cuda"
if SMOKE:
    DECODE_CASES, PREFILL_CASE, MIXED_CASE = [(3, 300)], (2, 40), ([40, 300, 0], [40, 1, 2])
    RAGGED_CASES = {"4xU(10,300)": (4, 10, 300)}
    DEVICE, ROTATIONS, ITERS = "cpu", 2, 1


# ----------------------------------------------------------------------------- timing

def time_graph(calls) -> float:
    return cuda_timing.time_graph(calls, ITERS, DEVICE)


def copy_bandwidth() -> float:
    if DEVICE != "cuda":
        return 1e11
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    src.random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(ITERS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return 2 * n / statistics.median(times)


# ----------------------------------------------------------------------------- batches

def make_batch(seq_lens, query_lens, gen, max_seq_len=None):
    """Random q and caches on the GPU, block tables in random order."""
    blocks = [triton.cdiv(s, BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks) + 1
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    width = max(blocks) + 1
    bt = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    i = 0
    for r, nb in enumerate(blocks):
        bt[r, :nb] = perm[i:i + nb]
        i += nb
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE)
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    num_tokens = int(qsl[-1])
    q = torch.randn((num_tokens, NUM_HEADS, HEAD_DIM), device=DEVICE, dtype=DTYPE)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=qsl.to(DEVICE), seq_lens=lens.to(DEVICE),
        block_table=bt.to(DEVICE), slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int32).to(DEVICE),
        max_query_len=max(query_lens), max_seq_len=max_seq_len or max(seq_lens),
        decode_order=torch.argsort(-lens, stable=True).to(torch.int32).to(DEVICE),  # as the runner does
        split_counters=torch.zeros(len(seq_lens) * NUM_KV_HEADS, dtype=torch.int32, device=DEVICE))
    return q, k_cache, v_cache, meta


def check(out, ref) -> float:
    err = (out.float() - ref.float()).abs().max().item()
    if not torch.isfinite(out).all() or err > 3e-2:
        raise AssertionError(f"max abs error {err}")
    return err


# ----------------------------------------------------------------------------- benchmarks

def bench_decode(variants, copy_bw, gen, results):
    # Correctness of every variant on ragged lengths (partial tiles, a padding row).
    nseq, longest = (32, 8192) if not SMOKE else (5, 300)
    lens = torch.randint(1, longest + 1, (nseq,), generator=gen).tolist()
    lens[0], lens[1], lens[2] = longest, 0, 17
    q, kc, vc, meta = make_batch(lens, [1] * nseq, gen)
    ref = paged_attention_ref(q, kc, vc, meta, SCALE)
    errors = {}
    for name, cfg in variants.items():
        out = torch.full_like(q, float("nan"))
        ta.paged_attention_triton(q, kc, vc, meta, SCALE, out=out, decode_config=cfg)
        errors[name] = check(out, ref)
    del q, kc, vc, meta, ref

    cases = {f"{batch}x{ctx}": [ctx] * batch for batch, ctx in DECODE_CASES}
    for label, (batch, lo, hi) in RAGGED_CASES.items():
        cases[label] = torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()
    for label, lens in cases.items():
        batch = len(lens)
        sets = [make_batch(lens, [1] * batch, gen) for _ in range(ROTATIONS)]
        outs = [torch.empty_like(s[0]) for s in sets]
        kv_bytes = sum(lens) * NUM_KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize
        qo_bytes = 2 * batch * NUM_HEADS * HEAD_DIM * DTYPE.itemsize
        nbytes = kv_bytes + qo_bytes
        for name, cfg in variants.items():
            calls = [(lambda s=s, o=o, cfg=cfg: ta.paged_attention_triton(
                s[0], s[1], s[2], s[3], SCALE, out=o, decode_config=cfg)) for s, o in zip(sets, outs)]
            ms = time_graph(calls)
            splits = ta.decode_num_splits(sets[0][3], NUM_KV_HEADS, DTYPE, HEAD_DIM,
                                          torch.device(DEVICE), cfg)
            bw = nbytes / (ms * 1e-3)
            row = dict(kind="decode", case=label, variant=name, config=dataclasses.asdict(cfg),
                       splits=splits, us=ms * 1e3, bytes=nbytes, floor_us=nbytes / copy_bw * 1e6,
                       tb_per_s=bw / 1e12, pct_copy=100 * bw / copy_bw, max_err=errors[name])
            results.append(row)
            print(f"decode  {row['case']:>15s} {name:10s} splits={splits:3d} {row['us']:8.1f} us "
                  f"{row['tb_per_s']:5.2f} TB/s {row['pct_copy']:5.1f}% copy", flush=True)
        del sets, outs


def bench_prefill(variants, matmul_peak, gen, results, case=None, sdpa=False):
    nseq, plen = case or PREFILL_CASE
    sets = [make_batch([plen] * nseq, [plen] * nseq, gen) for _ in range(ROTATIONS)]
    outs = [torch.empty_like(s[0]) for s in sets]
    q, kc, vc, meta = sets[0]
    # the reference (one sequence at a time) holds a [heads, len, len] fp32 score matrix
    ref = paged_attention_ref(q, kc, vc, meta, SCALE) if NUM_HEADS * plen * plen * 4 <= 8 << 30 else None
    flops = 4 * HEAD_DIM * NUM_HEADS * nseq * plen * (plen + 1) // 2
    for name, cfg in variants.items():
        out = torch.full_like(q, float("nan"))
        ta.paged_attention_triton(q, kc, vc, meta, SCALE, out=out, prefill_config=cfg)
        err = check(out, ref) if ref is not None else float("nan")
        calls = [(lambda s=s, o=o, cfg=cfg: ta.paged_attention_triton(
            s[0], s[1], s[2], s[3], SCALE, out=o, prefill_config=cfg)) for s, o in zip(sets, outs)]
        ms = time_graph(calls)
        tflops = flops / (ms * 1e-3) / 1e12
        row = dict(kind="prefill", case=f"{nseq}x{plen}", variant=name, config=dataclasses.asdict(cfg),
                   us=ms * 1e3, flops=flops, floor_us=flops / matmul_peak * 1e6, tflops=tflops,
                   pct_matmul=100 * tflops * 1e12 / matmul_peak, max_err=err)
        results.append(row)
        print(f"prefill {row['case']:>9s} {name:10s} {row['us']:8.1f} us {tflops:6.1f} TFLOP/s "
              f"({row['pct_matmul']:.0f}% of {matmul_peak / 1e12:.0f})", flush=True)
    if sdpa:
        bench_sdpa(nseq, plen, flops, matmul_peak, gen, results)


def bench_sdpa(nseq, plen, flops, matmul_peak, gen, results):
    """A reference ceiling: torch's SDPA backends on the same causal prompts, dense and
    contiguous ([batch, heads, len, head_dim], no block table; GQA expanded by the backend)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    qkv = [(torch.randn(nseq, NUM_HEADS, plen, HEAD_DIM, device=DEVICE, dtype=DTYPE),
            torch.randn(nseq, NUM_KV_HEADS, plen, HEAD_DIM, device=DEVICE, dtype=DTYPE),
            torch.randn(nseq, NUM_KV_HEADS, plen, HEAD_DIM, device=DEVICE, dtype=DTYPE)) for _ in range(ROTATIONS)]
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        def call(t, backend=backend):
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=True)
        try:
            ms = time_graph([lambda t=t: call(t) for t in qkv])
        except Exception as e:  # a backend this build or GPU lacks
            print(f"prefill {nseq}x{plen} sdpa-{backend.name}: unavailable ({type(e).__name__}: {str(e)[:80]})")
            continue
        tflops = flops / (ms * 1e-3) / 1e12
        results.append(dict(kind="prefill", case=f"{nseq}x{plen}", variant=f"sdpa-{backend.name.lower()}",
                            config=None, us=ms * 1e3, flops=flops, floor_us=flops / matmul_peak * 1e6,
                            tflops=tflops, pct_matmul=100 * tflops * 1e12 / matmul_peak, max_err=0.0))
        print(f"prefill {nseq}x{plen} sdpa-{backend.name.lower():20s} {ms * 1e3:8.1f} us {tflops:6.1f} TFLOP/s",
              flush=True)


def bench_mixed(gen, results):
    seq_lens, q_lens = MIXED_CASE
    sets = [make_batch(seq_lens, q_lens, gen) for _ in range(ROTATIONS)]
    outs = [torch.empty_like(s[0]) for s in sets]
    q, kc, vc, meta = sets[0]
    ref = paged_attention_ref(q, kc, vc, meta, SCALE)
    out = torch.full_like(q, float("nan"))
    ta.paged_attention_triton(q, kc, vc, meta, SCALE, out=out)
    err = check(out, ref)
    calls = [(lambda s=s, o=o: ta.paged_attention_triton(s[0], s[1], s[2], s[3], SCALE, out=o))
             for s, o in zip(sets, outs)]
    ms = time_graph(calls)
    results.append(dict(kind="mixed", case="1x2048 prefill + 31x4096 decode", variant="default",
                        us=ms * 1e3, max_err=err))
    print(f"mixed   1x2048 prefill + 31x4096 decode: {ms * 1e3:8.1f} us", flush=True)
    del sets, outs


def bench_graph_bound(gen, results):
    """Decode captured with max_seq_len = 131072 (a graph for the model's max length),
    replayed on rows of at most 1024 tokens: correct, and nearly as cheap as a tight bound."""
    nseq = 32 if not SMOKE else 4
    lens = torch.randint(1, 1025 if not SMOKE else 100, (nseq,), generator=gen).tolist()
    lens[3] = 0
    q, kc, vc, meta = make_batch(lens, [1] * nseq, gen, max_seq_len=131072)
    tight = dataclasses.replace(meta, max_seq_len=max(lens))
    ref = paged_attention_ref(q, kc, vc, meta, SCALE)
    out = torch.full_like(q, float("nan"))
    ms_loose = time_graph([lambda: ta.paged_attention_triton(q, kc, vc, meta, SCALE, out=out)])
    err = check(out, ref)  # the graph's output
    out2 = torch.empty_like(q)
    ms_tight = time_graph([lambda: ta.paged_attention_triton(q, kc, vc, tight, SCALE, out=out2)])
    results.append(dict(kind="graph_bound", case="32 x <=1024, bound 131072", variant="default",
                        us=ms_loose * 1e3, us_tight=ms_tight * 1e3, max_err=err,
                        splits=ta.decode_num_splits(meta, NUM_KV_HEADS, DTYPE, HEAD_DIM,
                                                    torch.device(DEVICE))))
    print(f"graph   32 x <=1024 decode, bound 131072: {ms_loose * 1e3:.1f} us "
          f"(tight bound {ms_tight * 1e3:.1f} us), max err {err:.2e}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="directory for attention_bench.json")
    ap.add_argument("--decode", action="append", default=[], metavar="NAME:k=v,...",
                    help="extra DecodeConfig variant, e.g. n128s2:block_n=128,num_stages=2")
    ap.add_argument("--prefill", action="append", default=[], metavar="NAME:k=v,...",
                    help="extra PrefillConfig variant, e.g. m64:block_m=64")
    ap.add_argument("--only", action="append", default=[],
                    help="run only these variant names (repeatable); default: all")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter self-check, tiny sizes")
    ap.add_argument("--prefill-case", action="append", default=[], metavar="SEQSxLEN",
                    help="prefill cases of SEQS fresh causal prompts of LEN tokens (repeatable); given, "
                         "only the prefill stage runs, over these cases, with torch SDPA references")
    ap.add_argument("--heads", default=None, metavar="Q:KV", help="q and KV heads (default 32:8, the 8B shape)")
    ap.add_argument("--matmul-peak", type=float, default=792e12, help="FLOP/s for %% of peak")
    ap.add_argument("--ragged", action="append", default=[], metavar="BATCH:LO:HI",
                    help="decode cases of BATCH rows with contexts uniform in [LO, HI] (repeatable); "
                         "given, they replace every other case and only the decode stage runs")
    args = ap.parse_args()
    assert SMOKE or torch.cuda.is_available(), "needs a CUDA GPU (or --smoke)"

    decode_variants = dict(DECODE_VARIANTS)
    decode_variants.update(parse_variant(s, ta.DecodeConfig) for s in args.decode)
    prefill_variants = dict(PREFILL_VARIANTS)
    prefill_variants.update(parse_variant(s, ta.PrefillConfig) for s in args.prefill)
    if args.only:
        decode_variants = {k: v for k, v in decode_variants.items() if k in args.only or k == "default"}
        prefill_variants = {k: v for k, v in prefill_variants.items() if k in args.only or k == "default"}

    global DECODE_CASES, RAGGED_CASES, NUM_HEADS, NUM_KV_HEADS
    if args.heads:
        NUM_HEADS, NUM_KV_HEADS = (int(x) for x in args.heads.split(":"))
    stages = ("decode", "prefill", "mixed", "graph_bound")
    prefill_cases = [tuple(int(x) for x in c.split("x")) for c in args.prefill_case]
    if prefill_cases:
        stages = ("prefill",)
    if args.ragged:
        DECODE_CASES, stages = [], ("decode",)
        RAGGED_CASES = {}
        for spec in args.ragged:
            batch, lo, hi = (int(x) for x in spec.split(":"))
            RAGGED_CASES[f"{batch}xU({lo},{hi})"] = (batch, lo, hi)

    t0 = time.time()
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if SMOKE:
        props = dataclasses.make_dataclass("P", ["name", "multi_processor_count"])("cpu", 0)
    else:
        props = torch.cuda.get_device_properties(0)
    copy_bw = copy_bandwidth()
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}; copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)", flush=True)
    results: list[dict] = []
    failures = []
    for label, fn in [("decode", lambda: bench_decode(decode_variants, copy_bw, gen, results)),
                      ("prefill", lambda: [bench_prefill(prefill_variants, args.matmul_peak, gen, results, c,
                                                         sdpa=not SMOKE) for c in prefill_cases]
                       if prefill_cases else bench_prefill(prefill_variants, args.matmul_peak, gen, results)),
                      ("mixed", lambda: bench_mixed(gen, results)),
                      ("graph_bound", lambda: bench_graph_bound(gen, results))]:
        if label not in stages:
            continue
        try:
            fn()
        except Exception as e:  # keep going: one GPU run should report as much as it can
            failures.append(f"{label}: {type(e).__name__}: {e}")
            print(f"FAILED {label}: {type(e).__name__}: {e}", flush=True)
        if not SMOKE:
            torch.cuda.empty_cache()

    print("\n| kind | case | variant | splits | us | TB/s or TFLOP/s | % of ceiling | max err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if r["kind"] == "decode":
            perf, pct = f"{r['tb_per_s']:.2f} TB/s", f"{r['pct_copy']:.1f}% copy"
        elif r["kind"] == "prefill":
            perf, pct = f"{r['tflops']:.0f} TFLOP/s", f"{r['pct_matmul']:.0f}% matmul"
        else:
            perf, pct = "", ""
        print(f"| {r['kind']} | {r['case']} | {r['variant']} | {r.get('splits', '')} | {r['us']:.1f} | "
              f"{perf} | {pct} | {r['max_err']:.1e} |")
    best = {}
    for r in results:
        if r["kind"] == "decode" and (r["case"] not in best or r["us"] < best[r["case"]]["us"]):
            best[r["case"]] = r
    for case, r in best.items():
        print(f"best decode {case}: {r['variant']} {r['pct_copy']:.1f}% of copy bandwidth")
    for f in failures:
        print("FAILED", f)
    elapsed = time.time() - t0
    print(f"total {elapsed:.0f} s")
    if args.out:
        path = write_json(args.out, "attention_bench.json",
                          dict(device=props.name, sm_count=props.multi_processor_count,
                               torch=torch.__version__, triton=triton.__version__,
                               copy_bw_bytes_per_s=copy_bw, results=results, failures=failures,
                               elapsed_s=elapsed), indent=1)
        print("wrote", path)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
