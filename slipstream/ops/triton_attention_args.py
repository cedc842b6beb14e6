"""The attention kernels' launch arguments that depend on the layer and the caller: the
softmax scale in base 2, and the optional features' arguments (an FP8 cache, a sliding
window, the qkv epilogue inside the decode kernel, a quantized output). An option that is
off passes nothing, so those launches compile as they did without it.
"""
from __future__ import annotations

import torch

from slipstream.ops.kv_quant import UNIT_SCALES, KVScales, is_fp8
from slipstream.ops.metadata import QKVEpilogue
from slipstream.quant.fp8 import QuantizedRows

LOG2E = 1.4426950408889634


def qk_scale(scale: float, k_cache: torch.Tensor, kv_scales: KVScales | None) -> float:
    """The kernels' softmax scale in base 2, with an FP8 cache's k_scale folded in."""
    if is_fp8(k_cache):
        scale = scale * (kv_scales or UNIT_SCALES).k_scale
    return scale * LOG2E


def fp8_args(k_cache: torch.Tensor, kv_scales: KVScales | None, stores: bool = False) -> dict:
    """The kernels' FP8 arguments (`stores`: the decode kernel's epilogue stores the newest
    K/V too); none for a cache of q's dtype, so those launches stay as they were."""
    if not is_fp8(k_cache):
        return {}
    sc = kv_scales or UNIT_SCALES
    args = {"v_scale": sc.v_scale, "KV_FP8": True}
    if stores:
        args.update(k_inv_scale=sc.inv_k, v_inv_scale=sc.inv_v)
    return args


def quant_out_args(quant_out: QuantizedRows | None, subset: bool, head_dim: int) -> dict:
    """The decode kernels' arguments for an output quantized in them (none for None)."""
    if quant_out is None:
        return {}
    if subset or head_dim % quant_out.group:
        raise ValueError(f"a quantized decode output needs every row a decode row and head_dim {head_dim} "
                         f"a multiple of its {quant_out.group}-column groups")
    return dict(qo_ptr=quant_out.q, so_ptr=quant_out.scale, stride_qot=quant_out.q.stride(0),
                stride_sot=quant_out.scale.stride(0), QUANT_GROUP=quant_out.group)


def window_arg(window: int | None) -> dict:
    """The kernels' WINDOW argument; none without a window, so those launches stay as they were."""
    return {"WINDOW": int(window)} if window else {}


def epilogue_args(epi: QKVEpilogue | None, q: torch.Tensor, meta) -> dict:
    """The decode kernel's epilogue arguments (none without one).  Absent norm weights are
    passed as q (never read: their constexpr switches are off)."""
    if epi is None:
        return {}
    if epi.hidden is not None or epi.bias is not None:
        raise ValueError("the qkv epilogue inside the decode kernel takes a finished qkv "
                         "(no row scale or bias left to apply)")
    cs = epi.cos_sin_cache if epi.cos_sin_cache.stride(-1) == 1 else epi.cos_sin_cache.contiguous()
    return dict(
        pos_ptr=epi.positions, cs_ptr=cs, slot_ptr=meta.slot_mapping,
        qw_ptr=q if epi.q_norm_weight is None else epi.q_norm_weight,
        kw_ptr=q if epi.k_norm_weight is None else epi.k_norm_weight,
        stride_cs=cs.stride(0), eps=float(epi.eps), EPILOGUE=True,
        Q_NORM=epi.q_norm_weight is not None, K_NORM=epi.k_norm_weight is not None,
        # no FMA contraction, as the qkv epilogue kernel is compiled: q and the stored K/V are
        # that kernel's
        enable_fp_fusion=False)
