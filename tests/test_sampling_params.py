import dataclasses
import math

import pytest

from slipstream.sampling.params import MAX_LOGPROBS, SamplingParams

# (field, bad value) pairs: each must raise a ValueError that names the field.
BAD_VALUES = [
    # max_tokens: int >= 1
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 1.5),
    ("max_tokens", 16.0),
    ("max_tokens", True),
    ("max_tokens", "16"),
    ("max_tokens", None),
    # min_tokens: int in [0, max_tokens]
    ("min_tokens", -1),
    ("min_tokens", 17),  # > default max_tokens 16
    ("min_tokens", 0.5),
    ("min_tokens", False),
    # temperature: finite >= 0
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1.0"),
    ("temperature", True),
    ("temperature", None),
    # top_p: (0, 1]
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.5),
    ("top_p", math.nan),
    ("top_p", False),
    # top_k: int >= -1
    ("top_k", -2),
    ("top_k", 2.0),
    ("top_k", True),
    ("top_k", "5"),
    ("top_k", 2**31),
    # min_p: [0, 1]
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("min_p", math.inf),
    ("min_p", True),
    # seed: int or None
    ("seed", 1.0),
    ("seed", "42"),
    ("seed", True),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    # stop: str | list[str] | None, non-empty strings
    ("stop", ""),
    ("stop", [""]),
    ("stop", ["ok", ""]),
    ("stop", 5),
    ("stop", [5]),
    ("stop", ["ok", None]),
    ("stop", b"bytes"),
    ("stop", {"a"}),
    # stop_token_ids: ints >= 0
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [2**31]),
    ("stop_token_ids", [1, 2.0]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 5),
    ("stop_token_ids", "12"),
    # ignore_eos / skip_special_tokens: bool
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("ignore_eos", None),
    ("skip_special_tokens", 0),
    ("skip_special_tokens", "false"),
    # repetition_penalty: finite > 0
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("repetition_penalty", math.nan),
    ("repetition_penalty", True),
    # presence / frequency penalties: finite in [-2, 2]
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("presence_penalty", math.nan),
    ("presence_penalty", True),
    ("frequency_penalty", 3),
    ("frequency_penalty", -math.inf),
    ("frequency_penalty", "0"),
    # logprobs: None or int in [0, 20]
    ("logprobs", -1),
    ("logprobs", MAX_LOGPROBS + 1),
    ("logprobs", 1.0),
    ("logprobs", True),
]


@pytest.mark.parametrize(("name", "value"), BAD_VALUES, ids=[f"{n}={v!r}" for n, v in BAD_VALUES])
def test_bad_value_raises_naming_field(name, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{name: value})
    message = str(info.value)
    assert name in message
    assert "got" in message  # says what it received


def test_message_names_value_and_allowed_range():
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 1\.5$"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"max_tokens must be an int >= 1, got True \(bool\)"):
        SamplingParams(max_tokens=True)
    with pytest.raises(ValueError, match=r"temperature must be a finite number >= 0, got nan"):
        SamplingParams(temperature=math.nan)
    with pytest.raises(ValueError, match=r"logprobs must be None or in \[0, 20\], got 21"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_defaults_are_valid_and_as_documented():
    p = SamplingParams()
    assert p.max_tokens == 16
    assert p.min_tokens == 0
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == 0
    assert p.min_p == 0.0
    assert p.seed is None
    assert p.stop == ()
    assert p.stop_token_ids == []
    assert p.ignore_eos is False
    assert p.repetition_penalty == 1.0
    assert p.presence_penalty == 0.0
    assert p.frequency_penalty == 0.0
    assert p.logprobs is None
    assert p.skip_special_tokens is True
    assert not p.is_greedy
    assert not p.uses_penalties
    assert not p.uses_top_k_top_p
    assert p.sampler_seed is None


def test_defaults_are_not_shared_between_instances():
    a, b = SamplingParams(), SamplingParams()
    a.stop_token_ids.append(3)
    assert b.stop_token_ids == []


GOOD_VALUES = [
    ("max_tokens", 1),
    ("max_tokens", 10**6),
    ("min_tokens", 16),
    ("temperature", 0),
    ("temperature", 0.0),
    ("temperature", 5.0),
    ("top_p", 1e-9),
    ("top_p", 1),
    ("top_k", 0),
    ("top_k", -1),
    ("top_k", 50),
    ("min_p", 0),
    ("min_p", 1.0),
    ("seed", 0),
    ("seed", -7),
    ("seed", 2**64 - 1),
    ("seed", -(2**63)),
    ("stop", None),
    ("stop", []),
    ("stop", "x"),
    ("stop", ("a", "b")),
    ("stop_token_ids", None),
    ("stop_token_ids", (0, 7)),
    ("repetition_penalty", 1e-3),
    ("repetition_penalty", 10),
    ("presence_penalty", -2),
    ("presence_penalty", 2.0),
    ("frequency_penalty", -2.0),
    ("logprobs", 0),
    ("logprobs", MAX_LOGPROBS),
    ("ignore_eos", True),
    ("skip_special_tokens", False),
]


@pytest.mark.parametrize(("name", "value"), GOOD_VALUES, ids=[f"{n}={v!r}" for n, v in GOOD_VALUES])
def test_good_value_accepted(name, value):
    SamplingParams(**{name: value})


def test_normalisation():
    p = SamplingParams(top_k=-1, stop="###", stop_token_ids=(5, 6), temperature=0, top_p=1)
    assert p.top_k == 0
    assert p.stop == ("###",)
    assert p.stop_token_ids == [5, 6] and isinstance(p.stop_token_ids, list)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert SamplingParams(stop=["a", "b", "a"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()


def test_numpy_scalars_accepted():
    np = pytest.importorskip("numpy")
    p = SamplingParams(max_tokens=np.int64(8), temperature=np.float32(0.5), ignore_eos=np.bool_(True))
    assert type(p.max_tokens) is int and p.max_tokens == 8
    assert type(p.temperature) is float and p.temperature == 0.5
    assert p.ignore_eos is True


def test_properties():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-7).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=0.5).uses_penalties
    assert SamplingParams(frequency_penalty=-0.5).uses_penalties
    assert SamplingParams(top_k=5).uses_top_k_top_p
    assert SamplingParams(top_p=0.9).uses_top_k_top_p
    assert not SamplingParams(top_k=-1, top_p=1.0).uses_top_k_top_p


def test_seed_reduced_to_64_bits_for_sampler():
    assert SamplingParams(seed=2**64 - 1).sampler_seed == 2**64 - 1
    assert SamplingParams(seed=-1).sampler_seed == 2**64 - 1
    assert SamplingParams(seed=123).sampler_seed == 123
    assert SamplingParams(seed=-5).seed == -5  # the user's value is kept


def test_replace_revalidates():
    p = SamplingParams()
    assert dataclasses.replace(p, seed=3).seed == 3
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(p, top_p=2.0)
    with pytest.raises(ValueError, match="max_tokens"):
        p.clone(max_tokens=0)


def test_from_dict():
    p = SamplingParams.from_dict({"max_tokens": 5, "temperature": 0, "stop": ["\n"], "top_k": -1})
    assert (p.max_tokens, p.temperature, p.stop, p.top_k) == (5, 0.0, ("\n",), 0)
    # JSON null means "not given"
    p = SamplingParams.from_dict({"max_tokens": None, "top_p": None, "seed": None})
    assert p.max_tokens == 16 and p.top_p == 1.0 and p.seed is None
    # values are validated as usual
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams.from_dict({"temperature": -1})


def test_from_dict_round_trips_to_dict():
    p = SamplingParams(max_tokens=3, stop=["a", "b"], stop_token_ids=[1], seed=9, logprobs=2)
    assert SamplingParams.from_dict(p.to_dict()) == p


def test_unknown_fields_rejected_and_listed():
    with pytest.raises(ValueError) as info:
        SamplingParams.from_dict({"max_tokens": 4, "best_of": 2, "foo": 1})
    message = str(info.value)
    assert "best_of" in message and "foo" in message
    assert "max_tokens" not in message.split(";")[0]
    with pytest.raises(ValueError, match="n_tokens"):
        SamplingParams.from_kwargs(n_tokens=4)
    with pytest.raises(ValueError, match="mapping"):
        SamplingParams.from_dict(["max_tokens"])
