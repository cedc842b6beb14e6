"""Front ends: `LLM` (offline, blocking) and `AsyncLLM` (asyncio, streaming) on one engine
core, with the output processing (detokenization, stop strings, n completions) here."""
