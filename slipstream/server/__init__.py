"""The OpenAI-compatible HTTP server (`slipstream serve`) and the batch runner (`slipstream run-batch`)."""

#: the largest request body the server reads by default (--max-body-bytes)
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
