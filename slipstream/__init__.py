"""slipstream: an LLM inference engine whose continuous batching runs asynchronously."""
__version__ = "0.1.0"

from slipstream.engine import LLM, LLMEngine  # noqa: E402
from slipstream.request import RequestOutput  # noqa: E402
from slipstream.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
