"""The engine core: scheduler + runner + the overlap loop, run as a service.

`EngineCore` (engine_core.py) steps; `run_core` (service.py) is its loop, driven by
messages (messages.py) that arrive over ZMQ from a thread or another process;
`CoreClient` (client.py) starts a core and talks to it.
"""
