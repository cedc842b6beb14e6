"""The one table of per-request sampling columns: name, dtype, neutral value, and how a
request fills it.

It generates the request table's columns (request_table.py), the IO slot layout
(runner/slots.py), the gather and the padding of a batch (runner/inputs.py) and the
sampler's tensors (runner/model_runner.py): a new sampling field is one row here.
Neutral values are what padding rows and requests that do not use a feature carry.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class SamplingColumn:
    name: str
    dtype: type  # np.int32, np.int64 or np.float32
    neutral: float
    value: Callable | None = None  # request -> value; None: derived on the host (sampling_scalars)


SAMPLING_COLUMNS: tuple[SamplingColumn, ...] = (
    SamplingColumn("temperature", np.float32, 0.0, lambda r: 0.0 if r.params.is_greedy else r.params.temperature),
    SamplingColumn("top_k", np.int32, 0, lambda r: r.params.top_k),
    SamplingColumn("top_p", np.float32, 1.0, lambda r: r.params.top_p),
    SamplingColumn("min_p", np.float32, 0.0, lambda r: r.params.min_p),
    SamplingColumn("seed", np.int64, 0, lambda r: r.seed),
    SamplingColumn("repetition_penalty", np.float32, 1.0, lambda r: r.params.repetition_penalty),
    SamplingColumn("presence_penalty", np.float32, 0.0, lambda r: r.params.presence_penalty),
    SamplingColumn("frequency_penalty", np.float32, 0.0, lambda r: r.params.frequency_penalty),
)

#: computed per step from the columns above (runner/inputs.sampling_scalars)
DERIVED_COLUMNS: tuple[SamplingColumn, ...] = (
    SamplingColumn("inv_t", np.float32, 1.0),  # float32(1 / temperature), 1 for greedy rows
    SamplingColumn("log_min_p", np.float32, -np.inf),  # log(min_p), -inf = off
)

ALL_COLUMNS = SAMPLING_COLUMNS + DERIVED_COLUMNS


def int32_words(column: SamplingColumn) -> int:
    """32-bit words one value takes in a slot buffer."""
    return 2 if column.dtype == np.int64 else 1
