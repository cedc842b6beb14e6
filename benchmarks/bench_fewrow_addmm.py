"""cuBLAS at 1-8 rows on the products that add into the residual stream (Llama-3.1-8B's o_proj
and down_proj): `out.addmm_(x, W^T)` (beta = 1, the engine's `linear_add_`) against `torch.mm`
then `out.add_` (beta = 0, then an add kernel) and `torch.mm` alone.  A probe of whether
cuBLAS's algorithm choice with beta = 1 is what leaves the verification step's o_proj at ~1.6
TB/s (a plain product of the same shape, qkv's, takes a split-K kernel at ~3 TB/s).

Each form is timed with its weight rotated over enough copies to leave L2 (graph replays,
slipstream/bench/cuda_timing.py); reported: microseconds, the weight's read rate in TB/s and
each form's ratio to addmm.  `--device cpu` is a smoke run (numbers mean nothing).

Usage: python benchmarks/bench_fewrow_addmm.py [--rows 1 2 3 4 5 8] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

sys.path.insert(0, os.path.dirname(__file__))

from bench_fewrow_splitk import weight_copies  # noqa: E402

from slipstream.bench.cuda_timing import time_graph  # noqa: E402
from slipstream.bench.report import write_json  # noqa: E402

# (name, N out, K in): the 8B layer's two residual products, and qkv's shape as one for contrast
SHAPES = [("o_proj", 4096, 4096), ("down", 4096, 14336), ("qkv_as_add", 6144, 4096)]


def bench(rows: list[int], device: str, scale: int) -> list[dict]:
    out = []
    dt = torch.bfloat16
    for name, N, K in SHAPES:
        N, K = N // scale, K // scale
        nbytes = N * K * 2
        ws = weight_copies(N, K, device, dt)
        for M in rows:
            x = torch.randn(M, K, device=device, dtype=dt)
            res = torch.randn(M, N, device=device, dtype=dt)
            want = res.float() + (x.float() @ ws[0].float().t())
            a, b = res.clone(), res.clone()
            a.addmm_(x, ws[0].t())
            b.add_(torch.mm(x, ws[0].t()))
            tol = 0.02 * want.abs().max().item()
            assert (a.float() - want).abs().max().item() <= tol and (b.float() - want).abs().max().item() <= tol
            forms = {
                "addmm": [lambda w=w: res.addmm_(x, w.t()) for w in ws],
                "mm_add": [lambda w=w: res.add_(torch.mm(x, w.t())) for w in ws],
                "mm": [lambda w=w: torch.mm(x, w.t()) for w in ws],
            }
            row = {"product": name, "N": N, "K": K, "rows": M}
            for form, calls in forms.items():
                ms = time_graph(calls, device=device)
                row[f"{form}_us"] = 1e3 * ms
                row[f"{form}_tbs"] = nbytes / (ms * 1e-3) / 1e12
            out.append(row)
            print(" | ".join([f"{name:10s}", f"M={M}"] + [
                f"{f} {row[f'{f}_us']:6.1f} us {row[f'{f}_tbs']:.2f} TB/s ({row[f'{f}_us'] / row['addmm_us']:.2f}x)"
                for f in forms]), flush=True)
        del ws
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    scale = 1 if a.device == "cuda" else 64  # (a CPU smoke run: tiny shapes)
    rows = bench(a.rows, a.device, scale)
    if a.out:
        dev = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
        write_json(a.out, "bench_fewrow_addmm.json", {"device": dev, "torch": torch.__version__, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
