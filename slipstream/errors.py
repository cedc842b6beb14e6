"""Errors a front end raises to its callers."""


class EngineDeadError(RuntimeError):
    """The engine core died (a step raised, or its process exited): no request can run."""
