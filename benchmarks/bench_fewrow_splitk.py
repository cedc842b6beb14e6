"""cuBLAS at 1-8 rows on the Llama-3.1-8B products, against the same product split along K
into S batched slices (`torch.bmm` over S [M, K/S] x [K/S, N] views of the weight, then a sum
over S): a probe of whether the verification step's few-row products lose bandwidth to too
few CTAs (o_proj, 4096 x 4096, ran at ~1.5 TB/s in the EAGLE-3 step's profile), before any
engine change.

Each product is timed with its weight rotated over enough copies to leave L2 (graph replays,
slipstream/bench/cuda_timing.py); reported: microseconds and the weight's read rate in TB/s,
and the split variants' ratio to cuBLAS.  `--device cpu` is a smoke run (numbers mean nothing).

Usage: python benchmarks/bench_fewrow_splitk.py [--rows 1 2 4 5 8] [--splits 2 4 8] [--out DIR]
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from slipstream.bench.cuda_timing import time_graph  # noqa: E402
from slipstream.bench.report import write_json  # noqa: E402

# (name, N out, K in): Llama-3.1-8B's layer products, its LM head, the EAGLE-3 head's fc and qkv
SHAPES = [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
          ("lm_head", 128256, 4096), ("eagle_fc", 4096, 12288), ("eagle_qkv", 6144, 8192)]
L2_BYTES = 64 << 20  # more than an H100's or H200's L2


def split_product(x: torch.Tensor, w: torch.Tensor, S: int) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T as S batched K-slices summed (float32 partials where bmm has
    out_dtype, else bf16 partials summed in float32)."""
    M, K = x.shape
    N = w.shape[0]
    xs = x.view(M, S, K // S).transpose(0, 1)  # [S, M, K/S]
    ws = w.view(N, S, K // S).permute(1, 2, 0)  # [S, K/S, N]
    return torch.bmm(xs, ws, out_dtype=torch.float32).sum(dim=0).to(x.dtype) if has_out_dtype(x.device) \
        else torch.bmm(xs, ws).float().sum(dim=0).to(x.dtype)


@functools.cache
def has_out_dtype(device: torch.device) -> bool:
    """Whether this device's bmm takes out_dtype (bf16 in, float32 out)."""
    try:
        a = torch.zeros(1, 1, 1, dtype=torch.bfloat16, device=device)
        torch.bmm(a, a, out_dtype=torch.float32)
        return True
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def weight_copies(N: int, K: int, device: str, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """Random [N, K] weights, as many copies as leave L2 when a timed graph rotates over them."""
    copies = max(1, -(-L2_BYTES // (N * K * dtype.itemsize))) if device == "cuda" else 1
    return [torch.randn(N, K, device=device, dtype=dtype) * 0.02 for _ in range(copies)]


def bench(rows: list[int], splits: list[int], device: str, scale: int) -> list[dict]:
    out = []
    dt = torch.bfloat16
    for name, N, K in SHAPES:
        N, K = N // scale, K // scale
        nbytes = N * K * 2
        ws = weight_copies(N, K, device, dt)
        for M in rows:
            x = torch.randn(M, K, device=device, dtype=dt)
            ref = torch.nn.functional.linear(x, ws[0])
            row = {"product": name, "N": N, "K": K, "rows": M}
            ms = time_graph([lambda w=w: torch.nn.functional.linear(x, w) for w in ws], device=device)
            row["cublas_us"] = 1e3 * ms
            row["cublas_tbs"] = nbytes / (ms * 1e-3) / 1e12
            for S in splits:
                if K % S:
                    continue
                got = split_product(x, ws[0], S)
                err = (got.float() - ref.float()).abs().max().item()
                scale_ref = ref.float().abs().max().item() + 1e-6
                assert err <= 0.02 * scale_ref, (name, M, S, err, scale_ref)
                ms_s = time_graph([lambda w=w: split_product(x, w, S) for w in ws], device=device)
                row[f"split{S}_us"] = 1e3 * ms_s
                row[f"split{S}_x"] = ms_s / ms
            out.append(row)
            print(" | ".join([f"{name:9s}", f"M={M}", f"cuBLAS {row['cublas_us']:7.1f} us {row['cublas_tbs']:.2f} TB/s"]
                             + [f"split{S} {row[f'split{S}_us']:7.1f} us ({row[f'split{S}_x']:.2f}x)"
                                for S in splits if f"split{S}_us" in row]), flush=True)
        del ws
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 8])
    p.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    scale = 1 if a.device == "cuda" else 64  # (a CPU smoke run: tiny shapes)
    rows = bench(a.rows, a.splits, a.device, scale)
    if a.out:
        dev = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
        write_json(a.out, "bench_fewrow_splitk.json", {"device": dev, "torch": torch.__version__,
                                                       "out_dtype_bmm": has_out_dtype(torch.device(a.device)), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
