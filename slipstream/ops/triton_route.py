"""The MoE router's top-k in one Triton kernel: router logits [T, E] -> (weights float32 [T, k],
expert ids int32 [T, k]), the result of `slipstream.ops.moe.route`'s torch path (the CPU path and
the oracle, `tests/test_moe_route.py`).

Why: at batch 1 the torch path is ~5 launches a layer (float cast, softmax, topk, sum, divide,
int cast) around a few hundred bytes of work, and a decode step's time over the weights' floor
is mostly such launches. Here a layer's routing is one launch, in the PDL chain of the kernels
around it (`ops/pdl.py`).

Semantics, step for step as torch: p = exp(x - max) / sum(exp(x - max)) in float32 over the
row; the k largest p in decreasing order; when `renormalize`, each divided by the sum of the k.
The divisions are IEEE (`div_rn`; Triton's `/` is an approximate division) and on the GPU exp
is libdevice's (torch's expf; `tl.exp` is an approximate exp2), so a weight differs from torch's
by float32 rounding only (the order of the sums). Triton's interpreter has no libdevice: there
`tl.exp` (numpy's) runs.

Ties: among equal probabilities the lower expert id comes first. torch.topk on CUDA takes the
tied values at the k-th place in index order and sorts its k results, which in practice puts
equal values in index order too; the CPU topk (a partial sort) makes no such promise. The test
compares ids exactly on tie-free random logits, and checks the lower-id rule on its own.

How: BLOCK_T rows a program, each row's E logits one register tile (E up to 512, padded to a
power of two). Each of the k picks is one max-reduction over a 64-bit key per expert: the
probability's bits (a non-negative float32 orders as its int32 bits) above (BLOCK_E - 1 - id),
so the largest key is the largest probability and, among equals, the lowest id; the picked
expert's key is then set below every real one. Padding experts' keys start there.

Graph-safe: no host sync, the grid and the outputs' shapes depend on T, E and k only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from slipstream.ops.pdl import pdl_launch, pdl_start

__all__ = ["route_triton", "MAX_EXPERTS", "MAX_TOP_K"]

MAX_EXPERTS = 512  # one row's probabilities are one register tile
MAX_TOP_K = 16  # k picks, each a reduction over the row: unrolled
TILE_ELEMS = 2048  # BLOCK_T x BLOCK_E a program, at most (registers)


@triton.jit(do_not_specialize=["T"])
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, T, stride_t,
                  E: tl.constexpr, K: tl.constexpr, RENORMALIZE: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISE_EXP: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)  # the logits are the previous kernel's output
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    valid = row_ok[:, None] & (cols[None, :] < E)
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :], mask=valid,
                other=float("-inf")).to(tl.float32)
    x_max = tl.max(x, axis=1)
    # rows past T are all -inf: a finite max keeps their (unstored) lanes free of NaN
    x_max = tl.where(row_ok, x_max, 0.0)
    if PRECISE_EXP:
        ex = libdevice.exp(x - x_max[:, None])  # padding: exp(-inf) = 0
    else:
        ex = tl.exp(x - x_max[:, None])
    total = tl.sum(ex, axis=1)
    total = tl.where(row_ok, total, 1.0)
    p = tl.div_rn(ex, total[:, None])
    # the key: probability bits high, reversed id low (the module doc); -1 is below every real key
    bits = p.to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(valid, (bits << 32) | (BLOCK_E - 1 - cols[None, :]).to(tl.int64), -1)
    slots = tl.arange(0, BLOCK_K)
    top_p = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    top_id = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    for j in tl.static_range(K):
        best = tl.max(key, axis=1)
        expert = (BLOCK_E - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
        prob = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        top_p = tl.where(slots[None, :] == j, prob[:, None], top_p)
        top_id = tl.where(slots[None, :] == j, expert[:, None], top_id)
        key = tl.where(cols[None, :] == expert[:, None], -1, key)
    if RENORMALIZE:
        kept = tl.sum(top_p, axis=1)  # padding slots (j >= K) hold 0
        top_p = tl.div_rn(top_p, tl.where(row_ok, kept, 1.0)[:, None])
    out = rows[:, None] * K + slots[None, :]
    store = row_ok[:, None] & (slots[None, :] < K)
    tl.store(weights_ptr + out, top_p, mask=store)
    tl.store(ids_ptr + out, top_id, mask=store)


def route_applies(router_logits: torch.Tensor, top_k: int) -> bool:
    """Whether `route_triton` takes these shapes (the torch path takes the rest)."""
    e = router_logits.shape[-1]
    return (router_logits.dim() == 2 and 1 <= top_k <= min(e, MAX_TOP_K) and e <= MAX_EXPERTS
            and router_logits.dtype in (torch.float32, torch.float16, torch.bfloat16))


def route_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`route`'s (weights float32 [T, k], ids int32 [T, k]) in one launch; `out`: preallocated
    (weights, ids) to write (contiguous, those shapes and dtypes)."""
    if not route_applies(router_logits, top_k):
        raise ValueError(f"route_triton: logits {tuple(router_logits.shape)} {router_logits.dtype}, "
                         f"k={top_k} (2-D float, E <= {MAX_EXPERTS}, 1 <= k <= min(E, {MAX_TOP_K}))")
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    t, e = logits.shape
    dev = logits.device
    if out is None:
        weights = torch.empty((t, top_k), dtype=torch.float32, device=dev)
        ids = torch.empty((t, top_k), dtype=torch.int32, device=dev)
    else:
        weights, ids = out
    if t == 0:
        return weights, ids
    block_e = triton.next_power_of_2(e)
    block_t = min(triton.next_power_of_2(t), max(1, TILE_ELEMS // block_e))
    # one warp for a decode row of 128 experts: every reduction stays within the warp's shuffles
    num_warps = min(4, max(1, block_t * block_e // 256))
    _route_kernel[(triton.cdiv(t, block_t),)](
        logits, weights, ids, t, logits.stride(0), E=e, K=top_k, RENORMALIZE=bool(renormalize),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        PRECISE_EXP=logits.is_cuda, num_warps=num_warps, **pdl_launch(dev))
    return weights, ids
