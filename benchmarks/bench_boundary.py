#!/usr/bin/env python
"""What one grid-wide dependency costs: a kernel boundary (plain or PDL) against a barrier
inside one persistent kernel.

A one-row decode step is a chain of ~140 (0.6B shape) to ~160 (8B) kernels, each needing
the whole output of the one before (a GEMV needs the whole input row). A persistent layer
kernel would replace those boundaries with grid-wide barriers. This measures both on the
same dependency pattern, without the layer's work: in each of PHASES phases every program
reads the whole vector the previous phase wrote (NPROG x BLOCK fp32 values), and writes
its BLOCK values of the next (their maximum + 1, so every value is exactly the phase count
after one pass from zeros).

  chain         one launch per phase, plain stream order, in one CUDA graph
  chain-pdl     the same, launched with PDL (`ops/pdl.py`: wait, then launch dependents)
  persistent    one launch; after each phase every program adds 1 to a counter (release)
                and spins on it (acquire) until all programs of the phase have

µs a phase = the graph's median replay time / PHASES; the values are checked (every one
must be PHASES after the run). On a CPU (interpreter) only one program is run, since the
interpreter runs programs one after another and a barrier would wait forever.

Usage: python benchmarks/bench_boundary.py [--phases 140] [--programs 132,264,528]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from slipstream.bench.cuda_timing import time_graph  # noqa: E402
from slipstream.ops.pdl import pdl_launch, pdl_start  # noqa: E402

BLOCK = 8  # values a program writes per phase


@triton.jit
def _phase(src, dst, pid, n, BLOCK: tl.constexpr, VEC: tl.constexpr):
    offs = tl.arange(0, VEC)
    x = tl.load(src + offs, mask=offs < n, other=-1.0)
    y = tl.max(x, 0) + 1.0
    tl.store(dst + pid * BLOCK + tl.arange(0, BLOCK), tl.zeros([BLOCK], tl.float32) + y)


@triton.jit
def _chain_kernel(src, dst, n, BLOCK: tl.constexpr, VEC: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    _phase(src, dst, tl.program_id(0), n, BLOCK, VEC)


@triton.jit
def _persistent_kernel(buf, counter, n, phases, BLOCK: tl.constexpr, VEC: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for p in range(phases):
        src = buf + (p % 2) * n
        dst = buf + ((p + 1) % 2) * n
        _phase(src, dst, pid, n, BLOCK, VEC)
        # grid barrier: this phase's writes are released with the add, and the spin's
        # acquire makes every program's visible before the next phase reads them
        tl.atomic_add(counter, 1, sem="release", scope="gpu")
        target = (p + 1) * nprog
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")


def _sizes(nprog: int) -> tuple[int, int]:
    """(values a phase writes, the power of two a program loads them in)."""
    n = nprog * BLOCK
    return n, triton.next_power_of_2(n)


def chain_calls(buf: torch.Tensor, nprog: int, phases: int, pdl: bool) -> list:
    n, vec = _sizes(nprog)
    launch = pdl_launch(buf.device) if pdl else {"USE_PDL": False}
    halves = (buf[:n], buf[n:])
    return [lambda p=p: _chain_kernel[(nprog,)](halves[p % 2], halves[(p + 1) % 2], n,
                                                BLOCK=BLOCK, VEC=vec, **launch)
            for p in range(phases)]


def persistent_call(buf: torch.Tensor, counter: torch.Tensor, nprog: int, phases: int):
    n, vec = _sizes(nprog)

    def call():
        counter.zero_()
        _persistent_kernel[(nprog,)](buf, counter, n, phases, BLOCK=BLOCK, VEC=vec)
    return call


def run_variant(name: str, nprog: int, phases: int, device: str) -> tuple[float, tuple[float, float]]:
    """(µs a phase, (min, max) of the values after one pass of the phases from zeros)."""
    n, _ = _sizes(nprog)
    buf = torch.zeros(2 * n, dtype=torch.float32, device=device)
    if name == "persistent":
        counter = torch.zeros(1, dtype=torch.int32, device=device)
        calls = [persistent_call(buf, counter, nprog, phases)]
    else:
        calls = chain_calls(buf, nprog, phases, pdl=name == "chain-pdl")
    buf.zero_()
    for c in calls:  # one pass from zeros: the check
        c()
    out = buf[(phases % 2) * n:(phases % 2) * n + n]
    check = float(out.min()), float(out.max())
    ms = time_graph(calls, device=device) * len(calls)  # per call -> all phases
    return ms * 1e3 / phases, check


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phases", type=int, default=140)
    ap.add_argument("--programs", default="132,264,528", help="comma-separated program counts")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    programs = [int(x) for x in args.programs.split(",")] if args.device == "cuda" else [1]
    print(f"{args.phases} phases, µs a phase (median of 20 graph replays), {BLOCK} values a program")
    print("| programs | chain | chain-pdl | persistent |\n|---|---|---|---|")
    failed = False
    for nprog in programs:
        cells = []
        for name in ("chain", "chain-pdl", "persistent"):
            us, (lo, hi) = run_variant(name, nprog, args.phases, args.device)
            ok = lo == hi == float(args.phases)
            failed |= not ok
            cells.append(f"{us:.2f}" + ("" if ok else f" (WRONG: {lo}..{hi})"))
        print(f"| {nprog} | " + " | ".join(cells) + " |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
