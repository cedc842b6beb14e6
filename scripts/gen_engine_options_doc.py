"""Write docs/engine-options.md from EngineConfig's table of options.

    .venv/bin/python scripts/gen_engine_options_doc.py          # rewrites the doc
    .venv/bin/python scripts/gen_engine_options_doc.py --check  # exit 1 if it is stale
"""
from __future__ import annotations

import pathlib
import sys

from slipstream.cli.options import engine_options_markdown

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "engine-options.md"


def main(argv: list[str]) -> int:
    text = engine_options_markdown()
    if "--check" in argv:
        current = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
        if current != text:
            print(f"{DOC} is stale: run python scripts/gen_engine_options_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
