#!/usr/bin/env python
"""What a layer GEMM call costs the CPU (host µs a call, not GPU time), as the engine makes
it: `F.linear(x, w)` (qkv, gate_up) and `out.addmm_(x, w.t())` (o, down: the residual add
inside the GEMM, ops/linear.py), at the model shape's four weights and several row counts.

In a profiled engine start (docs/benchmarks.md, "Engine start", 2026-12-04-9c73de5/call3) these
calls took 66-128 µs of C++ time each, 0.82 s of the build: far more than a cuBLAS call's
usual host cost. This separates the candidates, per (weight, rows, BLAS library):
  first     the first call of the shape (cuBLAS picks and, on first use, loads its kernel)
  eager     the median of the next calls, the stream synchronized between them (so no call
            waits on a full launch queue)
  captured  the median of 10 calls while capturing a CUDA graph (as the engine's captures run them)
`--blas cublas,cublaslt` runs each library in turn (torch.backends.cuda.preferred_blas_library).
On a CPU only `first` and `eager` are measured (torch's own matmul), which is what the test
of this script runs.

Usage: python benchmarks/probe_gemm_host_cost.py [--model 0.6b|8b] [--rows 1,8,64,256,16384]
        [--blas cublas,cublaslt] [--calls 50] [--device cuda]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

# (hidden, q heads, kv heads, head dim, intermediate) of the benchmark shapes (design.md §7)
SHAPES = {"0.6b": (1024, 16, 8, 128, 3072), "8b": (4096, 32, 8, 128, 14336)}


def layer_weights(model: str, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A layer's four weights as the engine keeps them ([out, in])."""
    hidden, heads, kv, head_dim, inter = SHAPES[model]
    sizes = {"qkv": ((heads + 2 * kv) * head_dim, hidden), "o": (hidden, heads * head_dim),
             "gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    return {name: torch.randn(shape, device=device, dtype=dtype) * 0.02 for name, shape in sizes.items()}


def gemm_call(name: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor):
    """The call the engine makes for weight `name` (a closure over its tensors)."""
    if name in ("o", "down"):
        return lambda: out.addmm_(x, w.t())
    return lambda: F.linear(x, w)


def host_us(call, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e6


def measure(name: str, w: torch.Tensor, rows: int, calls: int, device: str) -> dict[str, float]:
    x = torch.randn(rows, w.shape[1], device=device, dtype=w.dtype)
    out = torch.zeros(rows, w.shape[0], device=device, dtype=w.dtype)
    call = gemm_call(name, x, w, out)
    first = host_us(call, device)
    eager = statistics.median(host_us(call, device) for _ in range(calls))
    result = {"first": first, "eager": eager}
    if device == "cuda":
        graph, times = torch.cuda.CUDAGraph(), []
        with torch.cuda.graph(graph):
            for _ in range(min(calls, 10)):  # (each F.linear output lives in the graph's pool)
                start = time.perf_counter()
                call()
                times.append((time.perf_counter() - start) * 1e6)
        result["captured"] = statistics.median(times)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="0.6b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="1,8,64,256,16384")
    ap.add_argument("--blas", default="cublas,cublaslt")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    libraries = args.blas.split(",") if cuda else ["(cpu)"]
    print(f"{torch.__version__}, {torch.cuda.get_device_name() if cuda else 'cpu'}, model {args.model}, "
          f"{args.calls} calls; host µs a call")
    print("| BLAS | weight | rows | first | eager | captured |\n|---|---|---|---|---|---|")
    for library in libraries:
        if cuda:
            torch.backends.cuda.preferred_blas_library(library)
        weights = layer_weights(args.model, args.device, dtype)  # (fresh: first calls are first again)
        for rows in (int(r) for r in args.rows.split(",")):
            for name, w in weights.items():
                r = measure(name, w, rows, args.calls, args.device)
                captured = f"{r['captured']:.1f}" if "captured" in r else "-"
                print(f"| {library} | {name} | {rows} | {r['first']:.1f} | {r['eager']:.1f} | {captured} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
