#!/usr/bin/env python
"""The cost of batch invariance in the GEMMs: cuBLAS against the batch-invariant Triton GEMM.

    python benchmarks/bench_gemm.py [--out DIR] [--smoke] [--model 0.6b] [--m 8 --m 64 ...]

For each linear of the Llama-3.1-8B and Qwen3-0.6B decoders (qkv, o, gate_up, down,
lm_head) at M = 32 and 256 rows (decode batches) and 4096 (a prefill chunk): time
`F.linear` (cuBLAS; with torch's BLAS preference set to cuBLASLt; under TunableOp, which
times cuBLAS's algorithms for the shape and keeps the fastest) and `invariant_linear`
(slipstream.ops.triton_gemm, the `--batch-invariant` path).  Bandwidth counts weight + a + y bytes ("%copy": over the
measured copy bandwidth), TFLOP/s counts 2 M N K.  Each call is timed in a CUDA graph over
3 rotating weight copies (no L2 reuse), median of 20 replays
(`slipstream.bench.cuda_timing`), after a check against `F.linear`.
--smoke runs tiny shapes under the Triton interpreter on the CPU.

(The first version of this script, 2026-11-29, compared cuBLAS with a split-K skinny Triton
GEMM for M <= 64; it lost on every decode shape but the LM head: results/2026-11-29-a351a0e/
skinny_gemm.log, docs/kernel-notes.md.)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402

from slipstream.bench.cuda_timing import time_graph  # noqa: E402
from slipstream.bench.report import write_json  # noqa: E402
from slipstream.bench.throughput import measure_ceilings  # noqa: E402
from slipstream.ops.triton_gemm import GemmConfig, invariant_linear  # noqa: E402

DEVICE, DTYPE, ITERS, ROT = "cuda", torch.bfloat16, 20, 3
# (model, name, N, K)
SHAPES = [("8b", "qkv", 6144, 4096), ("8b", "o", 4096, 4096), ("8b", "gate_up", 28672, 4096),
          ("8b", "down", 4096, 14336), ("8b", "lm_head", 128256, 4096),
          ("0.6b", "qkv", 4096, 1024), ("0.6b", "o", 1024, 2048), ("0.6b", "gate_up", 6144, 1024),
          ("0.6b", "down", 1024, 3072), ("0.6b", "lm_head", 151936, 1024)]
BATCHES = [32, 256, 4096]
CONFIG = GemmConfig()
if SMOKE:
    DEVICE, ITERS, ROT = "cpu", 1, 1
    SHAPES = [("tiny", "a", 96, 256)]
    BATCHES = [5, 40]
    CONFIG = GemmConfig(block_m=16, block_n=32, block_k=16, min_k_per_split=32, programs_per_sm=1)


def check(y: torch.Tensor, ref: torch.Tensor) -> float:
    err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
    if not torch.isfinite(y).all() or err > 2e-2:
        raise AssertionError(f"relative error {err}")
    return err


def _with_blas(library: str, fn, *args):
    """fn(*args) with torch's preferred BLAS library set to `library` (cuBLASLt picks its
    kernels by other heuristics than cuBLAS)."""
    old = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        return fn(*args)
    finally:
        torch.backends.cuda.preferred_blas_library(old)


def _tuned(fn):
    """fn under torch's TunableOp: the first call (eager) times every cuBLAS / cuBLASLt
    algorithm for the shape and keeps the fastest; the later calls (graph) replay it."""
    def call(w):
        return fn(w)

    def tuned(w):
        tunable = torch.cuda.tunable
        tunable.enable(True)
        try:
            if not getattr(tuned, "done", False):
                tunable.tuning_enable(True)
                call(w)
                tunable.tuning_enable(False)
                tuned.done = True
            return call(w)
        finally:
            tunable.enable(False)
    return tuned


def bench_shape(model, name, n, k, m, copy_bw, rows):
    if model == "8b" and name == "lm_head" and m > 256:
        return  # a prefill computes logits for its sampled rows only
    ws = [torch.randn(n, k, device=DEVICE, dtype=DTYPE) / k ** 0.5 for _ in range(ROT)]
    wts = {id(w): w.t().contiguous() for w in ws}  # the same weights stored [K, N]
    x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
    nbytes = (n * k + m * k + m * n) * DTYPE.itemsize
    ref = F.linear(x, ws[0])
    for variant, fn in [("cublas", lambda w: F.linear(x, w)),
                        ("cublaslt", lambda w: _with_blas("cublaslt", F.linear, x, w)),
                        ("tunable", _tuned(lambda w: F.linear(x, w))),
                        ("invariant", lambda w: invariant_linear(x, w, None, CONFIG)),
                        # other cuBLAS layouts: x @ W^T with W^T stored [K, N], and (W x^T)^T
                        ("cublas-kn", lambda w: torch.mm(x, wts[id(w)])),
                        ("cublas-wx", lambda w: torch.mm(w, x.t()).t().contiguous())]:
        try:
            err = check(fn(ws[0]), ref)
            ms = time_graph([lambda w=w: fn(w) for w in ws], ITERS, DEVICE)
        except Exception as e:  # report and go on: one GPU run should say as much as it can
            print(f"FAILED {model} {name} M={m} {variant}: {type(e).__name__}: {e}", flush=True)
            continue
        bw = nbytes / (ms * 1e-3)
        tflops = 2 * m * n * k / (ms * 1e-3) / 1e12
        rows.append(dict(model=model, linear=name, m=m, n=n, k=k, variant=variant, us=ms * 1e3,
                         tb_per_s=bw / 1e12, pct_copy=100 * bw / copy_bw, tflops=tflops, rel_err=err))
        print(f"{model:5s} {name:8s} M={m:5d} {variant:10s} {ms * 1e3:9.1f} us {bw / 1e12:5.2f} TB/s "
              f"{100 * bw / copy_bw:5.1f}% copy {tflops:6.1f} TFLOP/s", flush=True)
    del ws


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--model", choices=["8b", "0.6b"], help="only this model's shapes")
    ap.add_argument("--m", type=int, action="append", help="batch sizes (repeatable; default 32, 256, 4096)")
    args = ap.parse_args()
    t0 = time.time()
    torch.manual_seed(0)
    copy_bw = measure_ceilings(torch.device(DEVICE))[0] if DEVICE == "cuda" else 1e11
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"{gpu}, torch {torch.__version__}, triton {triton.__version__}; copy {copy_bw / 1e12:.2f} TB/s",
          flush=True)
    rows: list[dict] = []
    for model, name, n, k in SHAPES:
        if args.model and model != args.model and not SMOKE:
            continue
        for m in (args.m if args.m and not SMOKE else BATCHES):
            bench_shape(model, name, n, k, m, copy_bw, rows)
    print("\n| model | linear | M | cuBLAS us | cuBLASLt | TunableOp | invariant | cuBLAS [K, N] | cuBLAS (W x^T)^T |\n|---|---|---|---|---|---|---|---|---|")
    for key in sorted({(r["model"], r["linear"], r["m"]) for r in rows}, key=str):
        got = {r["variant"]: r["us"] for r in rows if (r["model"], r["linear"], r["m"]) == key}
        if "cublas" in got:
            rel = [f"{got[v] / got['cublas']:.2f}x" if v in got else "-" for v in ("cublaslt", "tunable", "invariant", "cublas-kn", "cublas-wx")]
            print(f"| {key[0]} | {key[1]} | {key[2]} | {got['cublas']:.1f} | " + " | ".join(rel) + " |")
    print(f"total {time.time() - t0:.0f} s")
    if args.out:
        write_json(args.out, "gemm_bench.json", dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                                                     copy_bw=copy_bw, date=time.strftime("%Y-%m-%d"), rows=rows),
                   indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
