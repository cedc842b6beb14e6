"""`EngineReplica`: the callable class Ray Data runs in each replica actor.

One long-lived `AsyncLLM` per actor; Ray Data hands it several batches at once, and every
row of every batch goes to the engine as soon as the semaphore of `max_pending_requests`
lets it, so the engine's continuous batching sees many requests at a time rather than one
batch after another.  A bad row ends in its own row; an engine core that died takes the
actor down with it, so that Ray replaces the replica and retries its batches.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os

from slipstream.errors import EngineDeadError
from slipstream.frontend.batch_rows import OUTPUT_COLUMNS, RowDefaults, RowResult, result_of
from slipstream.frontend.outputs import OutputKind
from slipstream.model.tokenizer import ChatOptions
from slipstream.ray.rows import parse_ray_row, request_columns

log = logging.getLogger("slipstream.ray")


class EngineReplica:
    def __init__(self, model: str | None, engine_options: dict, defaults: dict,
                 max_pending_requests: int, core: str = "process",
                 chat_template: str | None = None, chat_template_kwargs: dict | None = None,
                 text_as_chat: bool = False) -> None:
        from slipstream.frontend.async_llm import AsyncLLM
        self.llm = AsyncLLM(model, core=core, **engine_options)
        self.defaults = RowDefaults(dict(defaults), ChatOptions(template_kwargs=dict(chat_template_kwargs or {}),
                                                                template=chat_template), text_as_chat)
        self.max_pending = max_pending_requests
        self._pending: asyncio.Semaphore | None = None  # made on the loop that runs the calls
        self._ids = itertools.count()

    async def __call__(self, batch):
        if self._pending is None:
            self._pending = asyncio.Semaphore(self.max_pending)
        results = await asyncio.gather(*(self._run(row) for row in request_columns(batch)))
        if self.llm.is_dead:
            self._exit(self.llm.dead_error)
        yield with_results(batch, results)

    async def _run(self, row: dict) -> RowResult:
        try:
            request = parse_ray_row(row, self.defaults)
            prompt = request.engine_prompt(self.llm.tokenizer)
        except (ValueError, TypeError) as e:
            return RowResult(error=str(e))
        async with self._pending:
            out = None
            try:
                async for out in self.llm.generate(prompt, request.params, request_id=f"row-{next(self._ids)}",
                                                   output_kind=OutputKind.FINAL_ONLY):  # the row's result only
                    pass
            except EngineDeadError as e:
                self._exit(str(e))
            except (ValueError, TypeError) as e:
                return RowResult(error=str(e))
        return result_of(out)

    def _exit(self, why: str | None) -> None:
        # Not an exception: the rows are not at fault. The actor's death makes Ray start a
        # new replica and run this batch again there (once: max_task_retries=1).
        log.error("slipstream replica: the engine died (%s); exiting so Ray replaces it", why)
        os._exit(1)


def with_results(batch, results: list[RowResult]):
    """The batch (a pyarrow Table) with the output columns set from `results`."""
    import pyarrow as pa

    types = {"generated_text": pa.string(), "generated_tokens": pa.list_(pa.int64()),
             "num_input_tokens": pa.int64(), "num_generated_tokens": pa.int64(),
             "time_taken_llm": pa.float64(), "finish_reason": pa.string(), "error": pa.string()}
    keep = [c for c in batch.column_names if c not in OUTPUT_COLUMNS]
    table = batch.select(keep)
    for name in OUTPUT_COLUMNS:
        table = table.append_column(name, pa.array([getattr(r, name) for r in results], types[name]))
    return table
