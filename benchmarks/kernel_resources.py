"""Registers, spills and shared memory of the prefill attention kernel's configs, compiled
for sm_90 on a machine without a GPU (as `tests/test_attention_kernels.py
--compile-for-hopper` compiles them), and how many programs of each fit on an H100/H200 SM.

    python benchmarks/kernel_resources.py [--prefill NAME:field=v,...] [--groups 2,4]

Each variant is a `PrefillConfig` (fields as in bench_attention.py's --prefill); "default"
is always there. `--groups`: q heads a KV head (2: the Qwen3-0.6B shape, 4: Llama-3.1-8B),
head_dim 128, bf16. The figures come from this machine's Triton and `cuobjdump` (the GPU's
Triton may be another version), so they explain a measurement rather than replace one.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, HERE)

import torch  # noqa: E402

REGS_PER_SM, SHARED_PER_SM, WARPS_PER_SM = 65536, 228 * 1024, 64  # sm_90
SHARED_PER_PROGRAM_EXTRA = 1024  # the driver's reserve per block


def resources(cubin: bytes) -> dict:
    """REG / STACK / SHARED / LOCAL of the one kernel in `cubin` (cuobjdump's resource usage)."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             timeout=60).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if not m:
        raise SystemExit(f"cuobjdump gave no resource usage:\n{out[-1000:]}")
    return dict(zip(("regs", "stack", "shared_static", "local"), map(int, m.groups())))


def programs_per_sm(regs: int, shared: int, warps: int) -> int:
    """Resident programs an SM by registers (allocated per warp in units of 256), shared
    memory and warps, the smallest of the three."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = REGS_PER_SM // (per_warp * warps)
    by_shared = SHARED_PER_SM // (shared + SHARED_PER_PROGRAM_EXTRA)
    return min(by_regs, by_shared, WARPS_PER_SM // warps)


def compile_prefill(cfg, group: int) -> dict:
    """The prefill kernel as `prefill_attention` launches it with `cfg` for `group` q heads a
    KV head, compiled for sm_90: its launch constants and resources."""
    import slipstream.ops.triton_attention as ta
    from test_attention_kernels import compile_launch_for_hopper, make_batch, recorded_launches

    q, kc, vc, meta = make_batch([(600, 600), (300, 300)], 8, group, 128, 16, torch.bfloat16, seed=0)
    meta = replace(meta, max_query_len=600, max_seq_len=600)
    with recorded_launches(ta, ["_prefill_kernel"], []) as launches:
        ta.prefill_attention(q, kc, vc, meta, 0.1, torch.empty_like(q), cfg)
    (fn, args, kw), = launches
    compiled, consts, opts = compile_launch_for_hopper(fn, args, kw)
    res = resources(compiled.asm["cubin"])
    shared = compiled.metadata.shared
    return dict(consts, num_warps=opts["num_warps"], num_stages=opts["num_stages"], shared=shared,
                programs_per_sm=programs_per_sm(res["regs"], shared, opts["num_warps"]), **res)


def main() -> None:
    from bench_attention import parse_variant

    import slipstream.ops.triton_attention as ta
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", action="append", default=[], metavar="NAME:field=v,...")
    ap.add_argument("--groups", default="2,4")
    args = ap.parse_args()
    variants = [("default", ta.PrefillConfig())] + [parse_variant(s, ta.PrefillConfig) for s in args.prefill]
    import triton
    print(f"triton {triton.__version__}, sm_90, head_dim 128, bf16")
    print("| variant | q heads a KV head | BLOCK_M | WIDE_N | warps | stages | registers | stack bytes | shared bytes | programs an SM |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for group in map(int, args.groups.split(",")):
        for name, cfg in variants:
            r = compile_prefill(cfg, group)
            print(f"| {name} | {group} | {r['BLOCK_M']} | {r['WIDE_N']} | {r['num_warps']} | {r['num_stages']} | "
                  f"{r['regs']} | {r['stack']} | {r['shared']} | {r['programs_per_sm']} |", flush=True)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET: the kernels are compiled, not interpreted")
    main()
