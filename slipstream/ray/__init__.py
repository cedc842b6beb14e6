"""slipstream on a Ray cluster (the optional extra: `pip install "slipstream[ray]"`).

`build_processor(...)` maps a `ray.data.Dataset` of prompts to generations over a pool of
long-lived engine replicas (one Ray actor each, an `AsyncLLM` inside), following the row
conventions of `ray.data.llm`.  Ray is imported when this package is, never by
`import slipstream`.
"""
from slipstream.ray.cluster import init_ray, require_ray
from slipstream.ray.processor import OUTPUT_COLUMNS, build_processor

__all__ = ["OUTPUT_COLUMNS", "build_processor", "init_ray", "require_ray"]
