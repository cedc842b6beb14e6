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

Ties: among equal probabilities the lower expert id comes first. torch documents no order
among ties: its CUDA topk selects the tied values at the k-th place in index order, and its
sort of the k keeps equal values in index order in practice; its CPU topk (a partial sort)
does not (bf16 logits: expert 45 before an equal expert 2). So the tests compare ids exactly on
tie-free logits, and check the lower-id rule against a stable sort.

How: BLOCK_T rows a program, each row's E logits one register tile (E up to 512, padded to a
power of two). Each of the k picks is one max-reduction over a 64-bit key per expert: the
probability's bits (a non-negative float32 orders as its int32 bits) above (BLOCK_E - 1 - id),
so the largest key is the largest probability and, among equals, the lowest id; the picked
expert's key is then set below every real one. Padding experts' keys start there.

`route_linear_triton` also takes the router's linear (x [T, H] @ W[E, H]^T, T <= 16) into the
launch: each program computes BLOCK_N experts' logits (its weights loaded before the PDL wait, as
the GEMV's are), writes them to a float32 scratch, and counts itself done on an int32 counter;
the program that finds itself last (an acq_rel atomic after a barrier: every other program's
logits are visible to it) does the top-k above over all rows and sets the counter back to zero.
The counter is the caller's (one a layer): two launches that share one must not overlap.

Graph-safe: no host sync, the grid and the outputs' shapes depend on the shapes only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from slipstream.ops.device import sm_count
from slipstream.ops.pdl import pdl_launch, pdl_start
from slipstream.ops.triton_gemv import choose_block_n

__all__ = ["MAX_EXPERTS", "MAX_TOP_K", "new_route_counter", "route_linear_triton", "route_triton"]

MAX_EXPERTS = 512  # one row's probabilities are one register tile
MAX_TOP_K = 16  # k picks, each a reduction over the row: unrolled
TILE_ELEMS = 2048  # BLOCK_T x BLOCK_E a program, at most (registers)
# the fused router linear (`route_linear_triton`): a program holds BLOCK_N x H_PAD weights
MAX_LINEAR_ROWS = 16  # its rows are a loop over the program's weight tile: decode sizes
MAX_LINEAR_HIDDEN = 8192
TILE_ELEMS_LINEAR = 8192


@triton.jit
def _route_rows(logits_ptr, weights_ptr, ids_ptr, row0, T, stride_t,
                E: tl.constexpr, K: tl.constexpr, RENORMALIZE: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                PRECISE_EXP: tl.constexpr, FROM_L2: tl.constexpr):
    """Rows row0 .. row0 + BLOCK_T - 1 (those below T): their logits -> top-k weights and ids.
    FROM_L2: the logits were written by other programs of this kernel, so they are read past
    the SM's L1 (`.cg`)."""
    rows = row0 + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    valid = row_ok[:, None] & (cols[None, :] < E)
    ptrs = logits_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :]
    if FROM_L2:
        x = tl.load(ptrs, mask=valid, other=float("-inf"), cache_modifier=".cg").to(tl.float32)
    else:
        x = tl.load(ptrs, mask=valid, other=float("-inf")).to(tl.float32)
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


@triton.jit(do_not_specialize=["T"])
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, T, stride_t,
                  E: tl.constexpr, K: tl.constexpr, RENORMALIZE: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISE_EXP: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)  # the logits are the previous kernel's output
    _route_rows(logits_ptr, weights_ptr, ids_ptr, tl.program_id(0) * BLOCK_T, T, stride_t, E, K,
                RENORMALIZE, BLOCK_T, BLOCK_E, BLOCK_K, PRECISE_EXP, False)



@triton.jit(do_not_specialize=["T"])
def _route_linear_kernel(x_ptr, w_ptr, logits_ptr, counter_ptr, weights_ptr, ids_ptr, T, stride_x, stride_w,
                         E: tl.constexpr, H: tl.constexpr, H_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                         K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PRECISE_EXP: tl.constexpr,
                         USE_PDL: tl.constexpr):
    # each program: BLOCK_N experts' logits for every row; the last to finish: the top-k
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, H_PAD)
    nmask = offs_n < E
    hmask = offs_h < H
    # the router's weights stream before the PDL wait, as the GEMV's do (no kernel writes them)
    w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_w + offs_h[None, :],
                mask=nmask[:, None] & hmask[None, :], other=0.0).to(tl.float32)
    pdl_start(USE_PDL)
    for m in range(T):
        xr = tl.load(x_ptr + m * stride_x + offs_h, mask=hmask, other=0.0)
        logit = tl.sum(w * xr.to(tl.float32)[None, :], axis=1)
        # rounded to x's dtype, as the router linear's output is before `route` reads it
        logit = logit.to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(logits_ptr + m * E + offs_n, logit, mask=nmask)
    # every thread's stores before the one release; the program whose add returns the count
    # of the others has acquired all of them (the split-K semaphore's pattern)
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")  # zero for the next call
        for row0 in range(0, T, BLOCK_T):
            _route_rows(logits_ptr, weights_ptr, ids_ptr, row0, T, E, E, K, RENORMALIZE,
                        BLOCK_T, BLOCK_E, BLOCK_K, PRECISE_EXP, True)

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


def route_linear_applies(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> bool:
    """Whether `route_linear_triton` takes these shapes: up to MAX_LINEAR_ROWS rows, the
    hidden size within one program's register tile."""
    return (x.dim() == 2 and x.shape[0] <= MAX_LINEAR_ROWS and weight.dim() == 2
            and x.shape[1] == weight.shape[1] <= MAX_LINEAR_HIDDEN and x.dtype == weight.dtype
            and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and 1 <= top_k <= min(weight.shape[0], MAX_TOP_K) and weight.shape[0] <= MAX_EXPERTS)


def new_route_counter(device: torch.device) -> torch.Tensor:
    """The int32 counter a caller of `route_linear_triton` owns (zero; each call leaves it zero)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def route_linear_triton(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                        counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`route(F.linear(x, weight), top_k, renormalize)` in one launch for a few rows: x [T, H],
    the router's weight [E, H] (bias-free), the logits rounded to x's dtype as the linear's are.

    `counter` (`new_route_counter`) must not be shared by calls that may run at the same time
    (two streams): the programs count themselves on it to find the last, which does the top-k."""
    if not route_linear_applies(x, weight, top_k):
        raise ValueError(f"route_linear_triton: x {tuple(x.shape)} {x.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}, k={top_k}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    (t, h), e = x.shape, weight.shape[0]
    dev = x.device
    weights = torch.empty((t, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=dev)
    if t == 0:
        return weights, ids
    logits = torch.empty((t, e), dtype=torch.float32, device=dev)  # written and read in the launch
    h_pad = triton.next_power_of_2(h)
    # the GEMV's split of the columns: enough programs that every SM streams weights
    block_n = min(choose_block_n(e, sm_count(dev)), max(1, TILE_ELEMS_LINEAR // h_pad))
    block_e = triton.next_power_of_2(e)
    _route_linear_kernel[(triton.cdiv(e, block_n),)](
        x, weight, logits, counter, weights, ids, t, x.stride(0), weight.stride(0), E=e, H=h,
        H_PAD=h_pad, BLOCK_N=block_n, K=top_k, RENORMALIZE=bool(renormalize),
        BLOCK_T=min(triton.next_power_of_2(t), max(1, TILE_ELEMS // block_e)), BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), PRECISE_EXP=x.is_cuda, num_warps=4, **pdl_launch(dev))
    return weights, ids
