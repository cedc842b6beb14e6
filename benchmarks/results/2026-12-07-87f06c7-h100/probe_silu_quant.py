"""Call K1 (written as J2 of the session before): why test_gpu_down_product_with_silu_mul_in_the_quantization_at_8b_sizes[300]
differs in bits (17 and 64 rows equal): the fused SiLU·mul quantization against silu_and_mul
then quantize_rows (codes and scales), and _scaled_mm with fast accumulation twice on the same
inputs."""
import sys
import torch
sys.path[:0] = [".", "tests"]
from slipstream.ops.fused import silu_and_mul
from slipstream.ops.triton_fp8_quant import SiluMulRows, quantize_rows
from slipstream.ops.fp8_dispatch import fp8_product
from test_fp8_gemm_mid import _weight, _x

w = _weight(4096, 14336, None, False)
for m in (64, 300):
    gate_up, hidden = _x(m, 2 * 14336, seed=19), _x(m, 4096, seed=20)
    a = silu_and_mul(gate_up, hidden=hidden, eps=1e-5)
    q1, s1 = quantize_rows(SiluMulRows(gate_up, hidden, 1e-5))
    q2, s2 = quantize_rows(a)
    dq = (q1.view(torch.uint8) != q2.view(torch.uint8))
    print(f"m={m}: codes differ {int(dq.sum())} of {dq.numel()} in {int(dq.any(1).sum())} rows; "
          f"scales differ in {int((s1 != s2).sum())} rows")
    y1 = fp8_product(SiluMulRows(gate_up, hidden, 1e-5), w, None, "scaled_mm_fast")
    y2 = fp8_product(a, w, None, "scaled_mm_fast")
    y3 = fp8_product(a, w, None, "scaled_mm_fast")
    print(f"  products: fused vs two-kernel differ {int((y1 != y2).sum())}, two-kernel twice {int((y2 != y3).sum())}")
