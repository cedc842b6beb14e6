"""slipstream: an LLM inference engine whose continuous batching runs asynchronously."""
__version__ = "0.1.0"
