"""`python -m slipstream.server serve|run-batch ...`: the same commands as `slipstream serve`
and `slipstream run-batch`, usable before (or without) the main CLI."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from slipstream.cli import _engine_args
    from slipstream.server.cli import add_run_batch_parser, add_serve_parser

    parser = argparse.ArgumentParser(prog="python -m slipstream.server")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub, _engine_args)
    add_run_batch_parser(sub, _engine_args)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
