"""benchmarks/ptx_diff.py's pairing of two trees' launches (no compile)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from ptx_diff import match  # noqa: E402


def launch(kernel, ptx, **consts):
    return (kernel, consts, '{"num_warps": 4}', ptx)


def test_equal_launches_pair_in_order_and_a_new_knob_that_is_off_matches():
    # the same kernel compiled twice with the same constexprs (the compile check does that)
    a = [launch("k", ["x"], A=1), launch("k", ["y"], A=1), launch("j", ["z"], B=2)]
    b = [launch("k", ["x"], A=1), launch("k", ["y"], A=1), launch("j", ["z"], B=2, NEW=0)]
    pairs = match(a, b)
    assert [(x[3], y[3]) for x, y in pairs] == [(["x"], ["x"]), (["y"], ["y"]), (["z"], ["z"])]


def test_a_knob_that_is_on_matches_nothing():
    a = [launch("j", ["z"], B=2)]
    b = [launch("j", ["w"], B=2, NEW=1)]
    assert match(a, b) == [(a[0], None), (None, b[0])]
