"""GGUF's plain block formats dequantized in torch (model/gguf_dequant.py): bit for bit
`gguf.quants.dequantize`, whole and for a row range or a block-aligned column range; a
file's tensors read whole or sliced; bad ranges fail with a message."""
import gguf
import numpy as np
import pytest
import torch
from helpers import make_hf_model, write_gguf

from slipstream.model import gguf_dequant
from slipstream.model.gguf import GGUFFile
from slipstream.model.loader import embedded_model_path
from slipstream.model.shards import Slice

QTYPES = ["Q4_0", "Q4_1", "Q8_0"]


def _quantized(qtype: str, rows: int, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(raw bytes, gguf's own dequantization) of a random [rows, cols] matrix."""
    g = np.random.default_rng(seed)
    w = (g.standard_normal((rows, cols)) * g.uniform(0.01, 3.0, (rows, 1))).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block (scale 0)
    q = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(w, q)
    return raw, gguf.quants.dequantize(raw, q)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 32), (7, 96), (40, 256)])
def test_whole_tensor_is_the_reference_bit_for_bit(qtype, rows, cols):
    raw, want = _quantized(qtype, rows, cols, seed=rows + cols)
    got = gguf_dequant.dequantize(raw.reshape(-1), qtype, (rows, cols))
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert torch.equal(got, torch.from_numpy(want))


@pytest.mark.parametrize("qtype", QTYPES)
def test_row_and_column_ranges_are_the_reference_narrowed(qtype):
    raw, want = _quantized(qtype, 24, 192, seed=3)
    want = torch.from_numpy(want)
    flat = raw.reshape(-1)
    assert torch.equal(gguf_dequant.dequantize(flat, qtype, (24, 192), rows=(5, 11)), want[5:16])
    assert torch.equal(gguf_dequant.dequantize(flat, qtype, (24, 192), cols=(64, 96)), want[:, 64:160])
    assert torch.equal(gguf_dequant.dequantize(flat, qtype, (24, 192), rows=(0, 3), cols=(160, 32)),
                       want[:3, 160:192])


def test_bad_ranges_and_shapes_fail_with_a_message():
    raw, _ = _quantized("Q8_0", 4, 64, seed=1)
    with pytest.raises(ValueError, match=r"columns \[16, 48\) are not whole blocks of 32"):
        gguf_dequant.dequantize(raw.reshape(-1), "Q8_0", (4, 64), cols=(16, 32))
    with pytest.raises(ValueError, match="rows are not whole blocks of 32"):
        gguf_dequant.dequantize(raw.reshape(-1), "Q8_0", (8, 32 - 16))
    with pytest.raises(ValueError, match="a row range of a 3-d tensor"):
        gguf_dequant.dequantize(raw.reshape(-1), "Q8_0", (2, 2, 64), rows=(0, 1))


@pytest.mark.slow
def test_the_embedded_models_tensors_whole_and_sliced():
    f = GGUFFile(embedded_model_path())
    seen = set()
    for name, info in f.tensors.items():
        if info.qtype.name in seen or len(info.shape) != 2:
            continue
        seen.add(info.qtype.name)
        want = f.read_reference(name)  # gguf.quants.dequantize
        assert torch.equal(f.read(name), want), name
        r, c = info.shape
        for s in (Slice(0, r // 4, r // 2, r), Slice(1, 32, 64, c), Slice(1, 5, 40, c)):  # the last: not aligned
            got = f.read(name, s)
            assert torch.equal(got, want.narrow(s.dim, s.start, s.length)), (name, s)
    assert {"Q4_1", "Q8_0"} <= seen  # the types of the embedded model


@pytest.mark.parametrize("qtype", QTYPES)
def test_a_quantized_llama_gguf_loads_its_permuted_heads_by_rows(qtype, tmp_path):
    # llama.cpp permutes q/k rows within each head: a slice of whole heads, dequantized
    # alone and put back in order, equals the whole tensor put back in order and narrowed
    hf = make_hf_model("llama", str(tmp_path / "hf"))
    path = str(tmp_path / "m.gguf")
    write_gguf(hf, path, qtype)
    f = GGUFFile(path)
    config = f.config()
    loaders = {name: load for name, _, load in f.iter_hf_tensors(config)}
    q = loaders["model.layers.0.self_attn.q_proj.weight"]
    whole = q()
    d = config.head_dim
    for start_head, heads in [(0, 2), (2, 2), (1, 3)]:
        s = Slice(0, start_head * d, heads * d, whole.shape[0])
        assert torch.equal(q(s), whole[start_head * d:(start_head + heads) * d])
    assert f.tensors["blk.0.attn_q.weight"].qtype.name == qtype
    hf_q = hf.state_dict()["model.layers.0.self_attn.q_proj.weight"].float()
    assert (whole - hf_q).abs().max() < 0.1 * hf_q.abs().max()  # quantized, in the HF row order
