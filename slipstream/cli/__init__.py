"""The `slipstream` command (`slipstream.cli.main:main`): generate | serve | run-batch | bench."""
