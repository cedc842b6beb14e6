"""`slipstream generate --ray --input IN --output OUT`: a batch job through Ray Data.

IN is JSONL (`.jsonl`/`.json`) or Parquet (`.parquet`), a file or a folder of such files;
rows are those of `slipstream.frontend.batch_rows`, as `generate --input` reads them
without Ray (`ray.data.llm`'s conventions; any other column is passed through).  OUT ending in `.jsonl`/`.json`/`.parquet` is one file, written
by this process as results stream in; any other OUT is a folder that Ray's writers fill
with one file per block (JSONL, or Parquet with --output-format parquet), the way a
cluster job writes to shared storage.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

JSON_EXT, PARQUET_EXT = (".jsonl", ".json"), (".parquet",)


def input_format(path: str) -> str:
    if "://" not in path and not os.path.exists(path):
        raise FileNotFoundError(f"--input {path}: no such file or folder")
    names = [path]
    if os.path.isdir(path):
        names = sorted(os.listdir(path))
    for name in names:
        if name.endswith(JSON_EXT):
            return "json"
        if name.endswith(PARQUET_EXT):
            return "parquet"
    raise ValueError(f"--input {path}: expected a .jsonl, .json or .parquet file (or a folder of them)")


def read_dataset(path: str):
    import ray.data
    return ray.data.read_json(path) if input_format(path) == "json" else ray.data.read_parquet(path)


def write_dataset(ds, path: str, folder_format: str) -> tuple[int, int] | None:
    """Write the results; (rows, rows with an error) for a single file, None for a folder."""
    if path.endswith(JSON_EXT + PARQUET_EXT):
        return _write_one_file(ds, path)
    (ds.write_parquet if folder_format == "parquet" else ds.write_json)(path)
    return None


def _write_one_file(ds, path: str) -> tuple[int, int]:
    import pyarrow.parquet as pq

    rows = errors = 0
    tmp = path + ".partial"
    writer = None
    with open(tmp, "wb") as f:
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            rows += batch.num_rows
            errors += batch.num_rows - batch.column("error").null_count
            if path.endswith(PARQUET_EXT):
                writer = writer or pq.ParquetWriter(f, batch.schema)
                writer.write_table(batch)
            else:
                for row in batch.to_pylist():
                    f.write((json.dumps(row, ensure_ascii=False, default=str) + "\n").encode())
        if writer is not None:
            writer.close()
    os.replace(tmp, path)  # a job that failed leaves no half-written output under OUT
    return rows, errors


def run(a, sampling_defaults: dict, engine_kwargs: dict, chat=None) -> int:
    from slipstream.ray.cluster import init_ray
    from slipstream.ray.processor import build_processor

    if not a.input or not a.output:
        print("error: --ray needs --input and --output", file=sys.stderr)
        return 2
    input_format(a.input)  # a bad path fails before Ray starts
    folder = os.path.dirname(os.path.abspath(a.output))
    if "://" not in a.output and not os.path.isdir(folder):
        raise FileNotFoundError(f"--output {a.output}: the folder {folder} does not exist")
    engine_kwargs = dict(engine_kwargs)
    model = engine_kwargs.pop("model", None)
    processor = build_processor(model, replicas=a.replicas,
                                sampling_params=sampling_defaults, batch_size=a.batch_size,
                                max_pending_requests=a.max_pending_requests,
                                preserve_order=a.preserve_order,
                                chat_template=chat.template if chat else None,
                                chat_template_kwargs=chat.template_kwargs if chat else None,
                                text_as_chat=a.chat,
                                **engine_kwargs)
    ray = init_ray(a.ray_address)
    gpus = a.gpus_per_replica
    if gpus is None:  # a GPU each where the cluster has GPUs (unless --device cpu)
        gpus = 1 if engine_kwargs.get("device") != "cpu" and ray.cluster_resources().get("GPU", 0) else 0
    processor = dataclasses.replace(processor, gpus_per_replica=gpus)
    counts = write_dataset(processor(read_dataset(a.input)), a.output, a.output_format)
    if counts is None:
        print(f"wrote the results to the folder {a.output} (one file per block)", file=sys.stderr)
    else:
        rows, errors = counts
        print(f"wrote {rows} results to {a.output}: {rows - errors} ok, {errors} failed", file=sys.stderr)
    return 0
