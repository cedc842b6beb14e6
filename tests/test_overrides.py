"""slipstream.utils.overrides: text overrides of a config dataclass (tuning switches, bench variants)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from slipstream.ops.triton_fp8_gemv import Fp8GemvConfig
from slipstream.ops.triton_moe_small import SmallMoEConfig
from slipstream.utils.overrides import config_from_env, parse_overrides, parse_variant


def test_overrides_and_variants_of_a_config():
    assert parse_overrides(SmallMoEConfig, "down_block_n=4, num_warps=2") == {"down_block_n": 4, "num_warps": 2}
    assert parse_overrides(SmallMoEConfig, "") == {}
    name, cfg = parse_variant("w2:num_warps=2", SmallMoEConfig)
    assert (name, cfg) == ("w2", SmallMoEConfig(num_warps=2))
    assert config_from_env(SmallMoEConfig, "V", {"V": "down_block_n=4"}) == SmallMoEConfig(down_block_n=4)
    assert config_from_env(SmallMoEConfig, "V", {}) == SmallMoEConfig()
    assert config_from_env(Fp8GemvConfig, "V", {"V": "mma_block_k=128, max_rows=8"}) == Fp8GemvConfig(
        mma_block_k=128, max_rows=8)


@pytest.mark.parametrize("text", ["x=4", "num_warps", "num_warps=two"])
def test_a_bad_override_is_one_line_naming_it(text):
    with pytest.raises(ValueError, match=f"SLIPSTREAM_MOE_SMALL_CONFIG: '{text}' is not FIELD=INT with a field "
                                         "of SmallMoEConfig"):
        config_from_env(SmallMoEConfig, "SLIPSTREAM_MOE_SMALL_CONFIG", {"SLIPSTREAM_MOE_SMALL_CONFIG": text})


@pytest.mark.subprocess
def test_the_fp8_gemv_config_comes_from_the_environment():
    """SLIPSTREAM_FP8_GEMV_CONFIG sets the engine's FP8 GEMV config (read at import): a fresh
    interpreter sees the change, a bad value fails with its one-line error."""
    code = "from slipstream.ops.triton_fp8_gemv import DEFAULT_FP8_GEMV_CONFIG as c; print(c.mma_block_k, c.max_rows)"

    def run(value: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**os.environ, "SLIPSTREAM_FP8_GEMV_CONFIG": value})

    assert run("mma_block_k=128,max_rows=8").stdout.split() == ["128", "8"]
    bad = run("mma_block=1")
    assert bad.returncode != 0 and "SLIPSTREAM_FP8_GEMV_CONFIG: 'mma_block=1' is not FIELD=INT" in bad.stderr
