"""Text overrides of a config dataclass's integer fields ("block_n=128,num_warps=8"): the
environment's tuning switches and the benchmarks' variants read them the same way."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any


def parse_overrides(cls: type, text: str) -> dict[str, int | None]:
    """'field=int,...' (a value may be None) as keyword arguments of dataclass `cls`; a
    ValueError names an item that is not FIELD=INT with a field of `cls`."""
    fields = [f.name for f in dataclasses.fields(cls)]
    out: dict[str, int | None] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = (p.strip() for p in item.partition("="))
        if key not in fields or not (value == "None" or value.lstrip("-").isdigit()):
            raise ValueError(f"{item!r} is not FIELD=INT with a field of {cls.__name__} ({', '.join(fields)})")
        out[key] = None if value == "None" else int(value)
    return out


def parse_variant(spec: str, cls: type) -> tuple[str, Any]:
    """'name:field=int,...' -> (name, cls(**overrides)), a benchmark's named variant."""
    name, _, body = spec.partition(":")
    return name, cls(**parse_overrides(cls, body))


def config_from_env(cls: type, var: str, environ: Mapping[str, str] = os.environ) -> Any:
    """`cls`'s defaults with the "field=value,..." changes of environment variable `var` (a
    tuning switch for A/B runs in the engine); a bad item is a one-line ValueError naming the
    variable."""
    try:
        return cls(**parse_overrides(cls, environ.get(var, "")))
    except ValueError as e:
        raise ValueError(f"{var}: {e}") from None
