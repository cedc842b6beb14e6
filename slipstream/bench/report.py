"""Where benchmark results go: a JSON file in an output folder, created on demand."""
from __future__ import annotations

import json
import os


def write_json(folder: str, name: str, obj, indent: int = 2) -> str:
    """Write `obj` to folder/name; returns the path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        json.dump(obj, f, indent=indent)
    return path
