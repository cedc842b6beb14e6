"""slipstream: an LLM inference engine whose continuous batching runs asynchronously."""
__version__ = "0.1.0"

from slipstream.errors import EngineDeadError  # noqa: E402
from slipstream.frontend.async_llm import AsyncLLM  # noqa: E402
from slipstream.frontend.llm import LLM  # noqa: E402
from slipstream.frontend.outputs import CompletionOutput, RequestOutput  # noqa: E402
from slipstream.sampling_params import SamplingParams  # noqa: E402

__all__ = ["AsyncLLM", "CompletionOutput", "EngineDeadError", "LLM", "RequestOutput", "SamplingParams"]
