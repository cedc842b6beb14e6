"""Connecting to Ray: a clear error without the extra, and a lean local cluster."""
from __future__ import annotations

import os

RAY_MISSING = 'Ray is not installed; install the extra: pip install "slipstream[ray]"'


def require_ray():
    """The `ray` module, or a one-line ImportError naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise ImportError(RAY_MISSING) from None
    return ray


def init_ray(address: str | None = None, num_cpus: int | None = None,
             object_store_memory: int | None = None):
    """Connect to the cluster at `address` ("auto": the one this machine belongs to), or
    start a local one without the dashboard and usage reporting. Does nothing when this
    process is already connected."""
    ray = require_ray()
    if ray.is_initialized():
        return ray
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address:
        ray.init(address=address)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False,
                 object_store_memory=object_store_memory)
    return ray
