"""Where the CPU time of a workload run goes: cProfile around one run of the step loop.

Builds the engine as `slipstream bench` does, warms up, then profiles one run (async by
default) and prints the functions with the most own time and the most cumulative time.
With `--prefill-only`, only the steps that schedule a prefill chunk are profiled.

A constrained workload (small-256-json, ...) takes its grammar's vocabulary as `slipstream
bench` does (`--grammar-tokenizer`, default the embedded SmolLM2's); `--model` swaps the
workload's model folder (a tiny config with the same vocabulary profiles the CPU side on a
CPU); `--structured-outputs-workers` as the engine option.

Usage: python benchmarks/profile_cpu.py [--workload small-256] [--mode async] [--top 30]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from slipstream.bench.run import bench_grammar_tokenizer  # noqa: E402
from slipstream.bench.throughput import add_prompt, run_until_done  # noqa: E402
from slipstream.bench.workloads import get_workload  # noqa: E402
from slipstream.config import EngineConfig  # noqa: E402
from slipstream.core.engine_core import EngineCore  # noqa: E402
from slipstream.sampling.params import SamplingParams  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="small-256")
    ap.add_argument("--mode", default="async", choices=["sync", "async"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--prefill-only", action="store_true")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--model", default=None)
    ap.add_argument("--grammar-tokenizer", default=None)
    ap.add_argument("--structured-outputs-workers", type=int, default=0)
    args = ap.parse_args()
    w = get_workload(args.workload)
    n = args.num_requests or len(w.prompts)
    constrained = any(p.structured_outputs is not None for p in w.params[:n])
    engine = EngineCore(EngineConfig(model=args.model or w.model, load_format="dummy", device=args.device,
                                     structured_outputs_workers=args.structured_outputs_workers, **w.engine),
                        grammar_tokenizer=bench_grammar_tokenizer(args.grammar_tokenizer) if constrained else None)
    for i, (prompt, p) in enumerate(zip(w.prompts[:n], w.params[:n])):
        add_prompt(engine, f"warm-up-{i}", prompt,
                   SamplingParams(max_tokens=2, temperature=p.temperature, ignore_eos=True,
                                  structured_outputs=p.structured_outputs))
    run_until_done(engine)
    engine.set_async_scheduling(args.mode == "async")
    engine.reset_prefix_cache()
    prof = cProfile.Profile()
    prof.enable()
    for i, (prompt, params) in enumerate(zip(w.prompts[:n], w.params[:n])):
        add_prompt(engine, str(i), prompt, params)
    prof.disable()
    while engine.has_work():
        prefill = bool(engine.scheduler.waiting) or any(r.num_computed < r.num_tokens for r in engine.scheduler.running)
        if prefill or not args.prefill_only:
            prof.enable()
            engine.step()
            prof.disable()
        else:
            engine.step()
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
        print(f"## by {key}\n" + "\n".join(out.getvalue().splitlines()[4:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
