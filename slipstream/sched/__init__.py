"""Continuous batching: the scheduler, the block pool and prefix cache, requests and their
table, and the registry of batches in flight. Host-side only: nothing here touches a device."""
