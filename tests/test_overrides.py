"""slipstream.utils.overrides: text overrides of a config dataclass (tuning switches, bench variants)."""
from __future__ import annotations

import pytest

from slipstream.ops.triton_moe_small import SmallMoEConfig, config_from_env
from slipstream.utils.overrides import parse_overrides, parse_variant


def test_overrides_and_variants_of_a_config():
    assert parse_overrides(SmallMoEConfig, "down_block_n=4, num_warps=2") == {"down_block_n": 4, "num_warps": 2}
    assert parse_overrides(SmallMoEConfig, "") == {}
    name, cfg = parse_variant("w2:num_warps=2", SmallMoEConfig)
    assert (name, cfg) == ("w2", SmallMoEConfig(num_warps=2))
    assert config_from_env("down_block_n=4") == SmallMoEConfig(down_block_n=4)
    assert config_from_env(None) == SmallMoEConfig()


@pytest.mark.parametrize("text", ["x=4", "num_warps", "num_warps=two"])
def test_a_bad_override_is_one_line_naming_it(text):
    with pytest.raises(ValueError, match=f"SLIPSTREAM_MOE_SMALL_CONFIG: '{text}' is not FIELD=INT with a field "
                                         "of SmallMoEConfig"):
        config_from_env(text)
