"""The safetensors files of a checkpoint folder: its index's shards, one model.safetensors, or
every *.safetensors in it (the weight loader, the EAGLE-3 loader and the KV-scale reader)."""
from __future__ import annotations

import glob
import json
import os


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index ({e!r})") from None
        files = []
        for name in sorted(set(weight_map.values())):
            shard = os.path.join(folder, name)
            if not os.path.isfile(shard):
                raise FileNotFoundError(f"weight shard {name} listed in {index} does not exist")
            files.append(shard)
        return files
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if files:
        return files
    other = [os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.bin")) +
             glob.glob(os.path.join(folder, "*.pt"))]
    hint = f" (found {', '.join(other)}: only safetensors weights are supported)" if other else ""
    raise FileNotFoundError(f"{folder} has no weights: no model.safetensors or "
                            f"model.safetensors.index.json{hint}")
