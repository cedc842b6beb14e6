"""slipstream: an LLM inference engine whose continuous batching runs asynchronously."""
from slipstream.version import __version__  # noqa: F401 (the package version)

# The public names load on first use (PEP 562), so tools that need none of them (the
# serving load generator, `slipstream --help`) start without importing torch.
_PUBLIC = {
    "AsyncLLM": "slipstream.frontend.async_llm",
    "CompletionOutput": "slipstream.frontend.outputs",
    "EngineDeadError": "slipstream.errors",
    "LLM": "slipstream.frontend.llm",
    "OutputKind": "slipstream.frontend.outputs",
    "RequestOutput": "slipstream.frontend.outputs",
    "SamplingParams": "slipstream.sampling.params",
    "StructuredOutputsParams": "slipstream.sampling.structured",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'slipstream' has no attribute {name!r}")
