"""Building an `LLM` for a command-line front end: one process, one engine."""
from __future__ import annotations


def load_llm(engine_kwargs: dict):
    from slipstream.utils.process import freeze_gc
    from slipstream.frontend.llm import LLM
    llm = LLM(**engine_kwargs)
    freeze_gc()
    return llm
