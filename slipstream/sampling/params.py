"""What a request asks for: how many tokens, how to sample them, when to stop.

`SamplingParams` validates every field when it is built (and again on
`dataclasses.replace`), so the scheduler, the sampler and the detokenizer can
trust it. Every error is a `ValueError` that names the field, repeats the value
and says what is allowed, e.g. ``top_p must be in (0, 1], got 1.5``.

Normalisation done at construction:

* ``top_k = -1`` (vLLM's "off") becomes ``0`` (our "off");
* ``stop`` (a str, a list/tuple of str or None) becomes a tuple of str, in the
  given order, duplicates dropped;
* ``stop_token_ids`` (None or a list/tuple of int) becomes a new list of int;
* numeric fields become plain Python ``int`` / ``float`` (numpy scalars accepted).

``seed`` keeps the value the user gave (in [-2**63, 2**64): what a 64-bit message field
carries, negative allowed); the sampler takes `SamplingParams.sampler_seed`, the seed
reduced to 64 bits. Integers the engine stores in int32 columns (top_k, stop_token_ids) are
bounded by `MAX_INT32`, so a value the engine cannot store is refused here, naming its field.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from slipstream.sampling.structured import StructuredOutputsParams

__all__ = ["SamplingParams", "MAX_LOGPROBS", "MAX_N", "MAX_INT32", "GREEDY_TEMPERATURE_EPS", "completion_seed"]

#: The largest number of top logprobs a request may ask for per sampled token.
MAX_LOGPROBS = 20

#: The most completions one request may ask for (SamplingParams.n).
MAX_N = 128

#: Temperatures below this sample greedily (dividing logits by a tiny number
#: only overflows; the argmax is what the user means).
GREEDY_TEMPERATURE_EPS = 1e-5

#: The largest value of an int the engine stores in an int32 column (top_k, token ids).
MAX_INT32 = (1 << 31) - 1

_U64 = 1 << 64
_SEED_RANGE = "in [-2**63, 2**64) or None"


def _describe(value: Any) -> str:
    """``repr`` of a value, shortened."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return text


def _describe_typed(value: Any) -> str:
    return f"{_describe(value)} ({type(value).__name__})"


def _check_int(name: str, value: Any, allowed: str) -> int:
    """An int (not a bool, not a float with an integral value)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int {allowed}, got {_describe_typed(value)}")
    return int(value)


def _check_float(name: str, value: Any, allowed: str) -> float:
    """A finite real number (an int is fine, a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number {allowed}, got {_describe_typed(value)}")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name} must be a finite number {allowed}, got {_describe(value)}")
    return result


def _check_bool(name: str, value: Any) -> bool:
    # numpy's bool_ is not a bool subclass; accept it explicitly by type name.
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    raise ValueError(f"{name} must be a bool (True or False), got {_describe_typed(value)}")


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request (vLLM-compatible names).

    Fields (defaults in brackets):

    max_tokens [16]          new tokens to generate at most; int >= 1.
    min_tokens [0]           EOS / stop_token_ids are masked until this many
                             tokens exist; int in [0, max_tokens].
    temperature [1.0]        >= 0; 0 (anything below 1e-5) means greedy.
    top_p [1.0]              nucleus sampling, in (0, 1]; 1 = off.
    top_k [0]                keep the k most likely tokens, k <= MAX_INT32; 0 = off (-1 is
                             accepted as off and stored as 0).
    min_p [0.0]              drop tokens whose probability is below min_p times
                             the top probability; in [0, 1]; 0 = off.
    seed [None]              int in [-2**63, 2**64) or None (the engine picks one).
                             Draws depend only on (seed, token index).
    stop [None -> ()]        str or list of str; generation ends at the first
                             occurrence of any of them (not included in output,
                             unless include_stop_str_in_output).
    include_stop_str_in_output [False] keep the stop string that ended the
                             output at the end of its text.
    stop_token_ids [[]]      extra token ids that end generation (the token is
                             kept in the output ids, its text is not shown if
                             special). ints in [0, MAX_INT32].
    ignore_eos [False]       keep generating past EOS.
    repetition_penalty [1.0] > 0; 1 = off (HF/CTRL style, prompt + output).
    presence_penalty [0.0]   in [-2, 2] (OpenAI style, output tokens).
    frequency_penalty [0.0]  in [-2, 2] (OpenAI style, output tokens).
    logprobs [None]          None, or the number of top logprobs (0..20) to
                             return with each sampled token; 0 = only the
                             sampled token's own logprob.
    skip_special_tokens [True] drop special tokens from the output text.
    n [1]                    completions of the prompt (1..MAX_N); the prompt is
                             computed once (prefix cache), completion i > 0 draws
                             from its own seed stream (`completion_seed`).
    prompt_logprobs [None]   None, or k in [0, 20]: the logprob of every prompt
                             token (the first has none) and the top k at its
                             position. Such requests skip the prefix cache.
    structured_outputs [None] None, or a StructuredOutputsParams (or a dict of its
                             fields): a JSON schema, regex, choice or grammar the
                             output must follow (sampling/structured.py).
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | tuple[str, ...] | None = None
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    n: int = 1
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        self._validate_and_normalise()

    # ------------------------------------------------------------------ checks
    def _validate_and_normalise(self) -> None:
        self.max_tokens = _check_int("max_tokens", self.max_tokens, ">= 1")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

        self.min_tokens = _check_int("min_tokens", self.min_tokens, ">= 0")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )

        self.temperature = _check_float("temperature", self.temperature, ">= 0")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

        self.top_p = _check_float("top_p", self.top_p, "in (0, 1]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

        self.top_k = _check_int("top_k", self.top_k, f"in [0, {MAX_INT32}] (0 or -1 = off)")
        if not -1 <= self.top_k <= MAX_INT32:
            raise ValueError(f"top_k must be in [0, {MAX_INT32}] (0 or -1 = off), got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0

        self.min_p = _check_float("min_p", self.min_p, "in [0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

        if self.seed is not None:
            self.seed = _check_int("seed", self.seed, _SEED_RANGE)
            if not -(1 << 63) <= self.seed < _U64:
                raise ValueError(f"seed must be an int {_SEED_RANGE}, got {_describe(self.seed)}")

        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)

        self.ignore_eos = _check_bool("ignore_eos", self.ignore_eos)

        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty, "> 0")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name), "in [-2, 2]")
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)

        if self.logprobs is not None:
            self.logprobs = _check_int("logprobs", self.logprobs, f"in [0, {MAX_LOGPROBS}] or None")
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(
                    f"logprobs must be None or in [0, {MAX_LOGPROBS}], got {self.logprobs}"
                )

        self.skip_special_tokens = _check_bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _check_bool("include_stop_str_in_output",
                                                      self.include_stop_str_in_output)

        self.n = _check_int("n", self.n, f"in [1, {MAX_N}]")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _check_int("prompt_logprobs", self.prompt_logprobs,
                                              f"in [0, {MAX_LOGPROBS}] or None")
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise ValueError(f"prompt_logprobs must be None or in [0, {MAX_LOGPROBS}], "
                                 f"got {self.prompt_logprobs}")
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)

    @staticmethod
    def _normalise_stop(stop: Any) -> tuple[str, ...]:
        allowed = "a non-empty str, a list of non-empty str, or None"
        if stop is None:
            return ()
        if isinstance(stop, str):
            items = [stop]
        elif isinstance(stop, (list, tuple)):
            items = list(stop)
        else:
            raise ValueError(f"stop must be {allowed}, got {_describe_typed(stop)}")
        result: list[str] = []
        for i, item in enumerate(items):
            if not isinstance(item, str):
                raise ValueError(
                    f"stop must be {allowed}, got {_describe(stop)} "
                    f"(item {i} is {_describe_typed(item)})"
                )
            if not item:
                raise ValueError(
                    f"stop strings must be non-empty, got {_describe(stop)} (item {i} is '')"
                )
            if item not in result:
                result.append(item)
        return tuple(result)

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> list[int]:
        allowed = f"a list of ints in [0, {MAX_INT32}]"
        if ids is None:
            return []
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be {allowed}, got {_describe_typed(ids)}")
        result: list[int] = []
        for i, item in enumerate(ids):
            if isinstance(item, bool) or not isinstance(item, numbers.Integral) or not 0 <= item <= MAX_INT32:
                raise ValueError(
                    f"stop_token_ids must be {allowed}, got {_describe(ids)} "
                    f"(item {i} is {_describe_typed(item)})"
                )
            result.append(int(item))
        return result

    # -------------------------------------------------------------- properties
    @property
    def is_greedy(self) -> bool:
        """Argmax sampling: temperature 0 (below `GREEDY_TEMPERATURE_EPS`)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def uses_penalties(self) -> bool:
        """Any of repetition / presence / frequency penalty is active."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def uses_top_k_top_p(self) -> bool:
        """top-k or top-p filtering is active (the sampler may skip the sort otherwise)."""
        return self.top_k > 0 or self.top_p < 1.0

    @property
    def sampler_seed(self) -> int | None:
        """The seed reduced to 64 bits, as an unsigned int in [0, 2**64); None if unset.

        To store it in a torch int64 tensor, map values >= 2**63 to value - 2**64.
        """
        if self.seed is None:
            return None
        return self.seed % _U64

    # ------------------------------------------------------------ construction
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, none_means_default: bool = True) -> SamplingParams:
        """Build from a mapping (e.g. parsed JSON); unknown names raise ValueError.

        With ``none_means_default`` (the default), a key whose value is None
        (JSON null) counts as not given and the field keeps its default, as in the
        OpenAI API. Note that an OpenAI ``max_tokens: null`` means "up to the
        context length": the server must fill that in itself before calling this.
        """
        if not isinstance(data, Mapping):
            raise ValueError(
                f"sampling parameters must be a mapping of field names to values, "
                f"got {_describe_typed(data)}"
            )
        known = set(cls.field_names())
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s): {', '.join(unknown)}; "
                f"allowed: {', '.join(cls.field_names())}"
            )
        kwargs = {
            k: v for k, v in data.items() if not (none_means_default and v is None)
        }
        return cls(**kwargs)

    @classmethod
    def from_validated(cls, data: Mapping[str, Any]) -> SamplingParams:
        """A SamplingParams validated where it was built, rebuilt from its `to_dict()` (the
        engine core's side of an AddRequest) without checking the values again: the front
        end's `validate_request` built it once. Only the names are checked, in O(1) (exactly
        the fields), so a malformed message is a ValueError, not a missing attribute later."""
        if not isinstance(data, Mapping) or data.keys() != _FIELD_NAMES:
            got = sorted(map(str, data)) if isinstance(data, Mapping) else type(data).__name__
            raise ValueError(f"sampling parameters must name exactly the fields "
                             f"{', '.join(cls.field_names())}; got {got}")
        params = object.__new__(cls)
        params.__dict__.update(data)
        params.stop = tuple(data["stop"])
        params.stop_token_ids = list(data["stop_token_ids"])
        if data["structured_outputs"] is not None:
            params.structured_outputs = StructuredOutputsParams.from_dict(data["structured_outputs"])
        return params

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> SamplingParams:
        """Like the constructor, but unknown names raise ValueError (not TypeError)
        and None means "default" for every field."""
        return cls.from_dict(kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-friendly dict (stop as a list); `from_dict` round-trips it."""
        d = dataclasses.asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        if self.structured_outputs is not None:
            d["structured_outputs"] = self.structured_outputs.to_dict()
        return d

    def clone(self, **changes: Any) -> SamplingParams:
        """A validated copy with some fields changed (e.g. ``seed`` picked by the engine)."""
        return dataclasses.replace(self, **changes)


_FIELD_NAMES = frozenset(SamplingParams.field_names())
_dataclass_init = SamplingParams.__init__


def _init_naming_unknown_fields(self, *args, **kwargs) -> None:
    """Unknown field names raise ValueError (like every bad value), not the dataclass's TypeError."""
    unknown = sorted(set(kwargs) - set(SamplingParams.field_names()))
    if unknown:
        raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}; "
                         f"allowed: {', '.join(SamplingParams.field_names())}")
    _dataclass_init(self, *args, **kwargs)


SamplingParams.__init__ = _init_naming_unknown_fields


def completion_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of a request seeded with `seed` (n > 1): completion 0
    keeps the seed, the others get distinct streams (a golden-ratio step, mod 2**63)."""
    return (seed + index * 0x9E3779B97F4A7C15) % (1 << 63) if index else seed
