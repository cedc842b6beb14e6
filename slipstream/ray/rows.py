"""The Ray path's side of the batch rows of `slipstream.frontend.batch_rows`.

A replica reads a row's request columns (`row_keys`) through the shared parser and adds
the `OUTPUT_COLUMNS`; every other column of the row is passed through untouched, as
`ray.data.llm` does.  One output row per input row: `n` must be 1, and logprobs, which
have no column here, are refused rather than dropped.
"""
from __future__ import annotations

from slipstream.frontend.batch_rows import BatchRow, RowDefaults, parse_row, row_keys
from slipstream.sampling.params import SamplingParams

NOT_WRITTEN = ("logprobs", "prompt_logprobs")  # written by the local `generate --input` only


def request_columns(batch) -> list[dict]:
    """Each row of a pyarrow batch as a dict of its request columns (the others stay in the
    batch, passed through)."""
    names = row_keys(batch.column_names)
    return batch.select(names).to_pylist() if names else [{}] * batch.num_rows


def parse_ray_row(row: dict, defaults: RowDefaults) -> BatchRow:
    """The request of a row (its request columns only); ValueError naming what is wrong."""
    parsed = parse_row(row, defaults)
    check_one_output(parsed.params)
    return parsed


def check_one_output(params: SamplingParams) -> None:
    if params.n != 1:
        raise ValueError(f"sampling_params n must be 1 in a Ray batch job (one output row per input row), "
                         f"got {params.n}")
    for name in NOT_WRITTEN:
        if getattr(params, name) is not None:
            raise ValueError(f"sampling_params {name} is not written by a Ray batch job "
                             f"(the local `generate --input` writes it)")


def check_defaults(sampling_params: dict | None) -> dict:
    """The processor's defaults, validated before any replica starts."""
    defaults = dict(sampling_params or {})
    check_one_output(SamplingParams.from_dict(defaults))
    return defaults
