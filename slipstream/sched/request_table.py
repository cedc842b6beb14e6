"""Host arrays indexed by a running request's row.

The scheduler writes a request's tokens, block ids and sampling parameters here when
they change (admission, a new block, a new token), so that building a batch of 256
requests is a handful of numpy gathers rather than a Python loop over requests.
Row `scratch_row` is never given out: padded rows of CUDA-graph batches point at it.
"""
from __future__ import annotations

import numpy as np

from slipstream.sched.request import Request
from slipstream.sampling.columns import SAMPLING_COLUMNS


class RequestTable:
    def __init__(self, num_rows: int, max_model_len: int, block_size: int) -> None:
        rows = num_rows + 1
        self.scratch_row = num_rows
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        # np.zeros maps untouched pages lazily, so wide tables cost only what is used.
        self.token_ids = np.zeros((rows, max_model_len), np.int32)
        self.block_table = np.zeros((rows, self.max_blocks), np.int32)
        # one array per sampling column (sampling_columns.py), e.g. self.columns["top_p"]
        self.columns = {c.name: np.full(rows, c.neutral, c.dtype) for c in SAMPLING_COLUMNS}
        self._free_rows = list(range(num_rows - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    @staticmethod
    def row_values(req: Request) -> dict[str, np.generic]:
        """The request's sampling columns, each cast to its column's dtype: OverflowError
        (or ValueError) for a value the table cannot store, before any row is taken."""
        return {c.name: np.dtype(c.dtype).type(c.value(req)) for c in SAMPLING_COLUMNS}

    def acquire(self, req: Request) -> int:
        values = self.row_values(req)
        row = self._free_rows.pop()
        tokens = req.token_ids()
        self.token_ids[row, :len(tokens)] = tokens
        for name, value in values.items():
            self.columns[name][row] = value
        return row

    def release(self, row: int) -> None:
        self._free_rows.append(row)

    def set_blocks(self, row: int, start: int, blocks: list[int]) -> None:
        self.block_table[row, start:start + len(blocks)] = blocks
