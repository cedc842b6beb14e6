"""The `slipstream` command: generate | serve | run-batch | bench."""
from slipstream.cli.main import main

__all__ = ["main"]
