"""A Ray Data batch job on 1 vs N engine replicas: wall time of the whole job (the replicas'
start-up included: a pool lives for one job) and generated tokens per second; a job of one
row per replica before it shows what the start-up alone costs.

    python benchmarks/ray_batch.py --replicas 1 2 --rows 128 --max-tokens 16 --device cpu
    python benchmarks/ray_batch.py --replicas 1 2 --gpus-per-replica 0.5 --model M \
        --gpu-memory-utilization 0.45 --rows 4096 --max-tokens 256     # two replicas on one GPU
"""
from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--gpus-per-replica", type=float, default=0)
    p.add_argument("--cpus-per-replica", type=float, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--num-cpus", type=int, default=None, help="of the local Ray instance")
    a = p.parse_args()

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from slipstream.ray import build_processor
    ray.init(num_cpus=a.num_cpus, include_dashboard=False, log_to_driver=False)
    rows = [{"id": i, "prompt": f"Write a short note about the number {i}."} for i in range(a.rows)]
    for n in a.replicas:
        processor = build_processor(a.model, replicas=n, gpus_per_replica=a.gpus_per_replica,
                                    cpus_per_replica=a.cpus_per_replica, batch_size=a.batch_size,
                                    sampling_params=dict(max_tokens=a.max_tokens, temperature=0,
                                                         ignore_eos=True),
                                    device=a.device, gpu_memory_utilization=a.gpu_memory_utilization)
        # a first job of one row per replica starts the replicas (the pool lives per job, so
        # this measures the start-up alone)
        start = time.perf_counter()
        processor(ray.data.from_items(rows[:n], override_num_blocks=n)).take_all()
        startup = time.perf_counter() - start
        start = time.perf_counter()
        out = processor(ray.data.from_items(rows, override_num_blocks=max(8, 4 * n))).take_all()
        wall = time.perf_counter() - start
        tokens = sum(r["num_generated_tokens"] for r in out)
        assert len(out) == a.rows and not any(r["error"] for r in out)
        print(json.dumps(dict(replicas=n, rows=a.rows, generated_tokens=tokens, job_s=round(wall, 2),
                              startup_job_s=round(startup, 2),
                              tok_per_s=round(tokens / wall, 1))), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
