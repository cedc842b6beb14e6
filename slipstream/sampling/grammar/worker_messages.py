"""The messages between the engine core and its grammar worker processes (worker_pool.py,
worker_main.py): msgspec structs, msgpack-encoded, one pipe per worker (bytes, no pickle).

A request is known to its worker by an integer id the core assigns (request ids may be
reused once a request ends; these never are). The core sends `AddGrammar` when a request
arrives (the worker starts compiling at once, off its step path) and one `Step` a constrained
step; the worker answers `Ready` once at start and a `StepDone` to each `Step`.
"""
from __future__ import annotations

import msgspec

__all__ = ["AddGrammar", "FromWorker", "Ready", "Step", "StepDone", "ToWorker"]


class AddGrammar(msgspec.Struct, tag="add", array_like=True):
    """A request now owned by the worker, with its grammar key (`GrammarKey`'s fields)."""
    grammar_id: int
    kind: str
    spec: str
    fixed_whitespace: bool


class Step(msgspec.Struct, tag="step", array_like=True):
    """One step, in this order: forget `finished`; each (id, tokens) of `accepts` accepts its
    tokens in order; each (id, row) of `fills` writes its next-token row into the shared
    bitmask `bitmask_name` ([bitmask_rows, bitmask_words] int32; the worker attaches it by
    name and keeps it until the name changes)."""
    finished: list[int]
    accepts: list[tuple[int, list[int]]]
    fills: list[tuple[int, int]]
    bitmask_name: str
    bitmask_rows: int
    bitmask_words: int


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The worker is up; `error`: the one-line reason it could not build its backend (it then
    exits, and its requests fail with that reason)."""
    pid: int
    error: str | None = None


class StepDone(msgspec.Struct, tag="done", array_like=True):
    """The rows of the step are written. errors: (id, one-line message) of requests that failed
    in it (a token their grammar rejects, a grammar the worker could not compile); their rows
    are all allowed and the worker ignores them from now on."""
    errors: list[tuple[int, str]]


ToWorker = AddGrammar | Step
FromWorker = Ready | StepDone
