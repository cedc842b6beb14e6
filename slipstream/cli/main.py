"""Command line: `slipstream generate | serve | run-batch | bench | bench serve`."""
from __future__ import annotations

import argparse
import json
import sys

from slipstream.cli.options import (BENCH_ENGINE_DEFAULTS, chat_args, chat_defaults, engine_args,
                                    engine_kwargs, workload_engine_kwargs)


def _ray_job_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ray (with --ray: the job runs through Ray Data; needs slipstream[ray])")
    g.add_argument("--ray", action="store_true",
                   help="run --input (JSONL or Parquet) on engine replicas of a Ray cluster")
    g.add_argument("--ray-address", default=None,
                   help="the cluster ('auto': the one this machine is in; default: a local one)")
    g.add_argument("--replicas", type=int, default=1, help="engine replicas (Ray actors)")
    g.add_argument("--gpus-per-replica", type=float, default=None,
                   help="default: 1 where the cluster has GPUs, else 0")
    g.add_argument("--batch-size", type=int, default=32, help="rows per Ray Data batch")
    g.add_argument("--max-pending-requests", type=int, default=None,
                   help="requests in each replica's engine at once (default 4 batches)")
    g.add_argument("--preserve-order", action="store_true", help="results in input order")
    g.add_argument("--output-format", default="jsonl", choices=["jsonl", "parquet"],
                   help="for an --output folder (a path not ending in .jsonl/.json/.parquet)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    # its own dest: `seed` is the engine option (--engine-seed)
    g.add_argument("--seed", dest="sampling_seed", type=int, default=None,
                   help="each request's seed (default: drawn by the engine from --engine-seed)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def _sampling_kwargs(a: argparse.Namespace) -> dict:
    return dict(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                min_p=a.min_p, seed=a.sampling_seed, stop=a.stop, ignore_eos=a.ignore_eos)


def cmd_generate(a: argparse.Namespace) -> int:
    from slipstream.sampling.params import SamplingParams

    if a.workload:
        return _generate_workload(a)
    if a.ray:
        from slipstream.ray.job import run
        SamplingParams(**_sampling_kwargs(a))  # reject bad flags before Ray starts
        return run(a, _sampling_kwargs(a), engine_kwargs(a), chat_defaults(a))
    if (a.prompt is None) == (a.input is None):
        print("error: give a prompt argument, --input prompts.jsonl or --workload NAME", file=sys.stderr)
        return 2
    defaults = _sampling_kwargs(a)
    SamplingParams(**defaults)  # reject bad flags before the model loads
    chat = chat_defaults(a)
    if a.input:
        return _generate_file(a, defaults)
    if a.resume:
        print("error: --resume needs --input and --output", file=sys.stderr)
        return 2
    from slipstream.cli.engine_setup import load_llm
    llm = load_llm(engine_kwargs(a))
    params = SamplingParams(**defaults)
    if a.chat:
        from slipstream.frontend.prompts import chat_token_ids
        prompt = chat_token_ids([{"role": "user", "content": a.prompt}], llm.tokenizer, chat)
    else:
        prompt = a.prompt
    from slipstream.frontend.outputs import OutputKind
    llm.add_request(prompt, params, output_kind=OutputKind.DELTA)
    out = None
    for out in llm.outputs():  # print the answer as it is generated
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
    if out is not None and out.error:
        print(f"error: {out.error}", file=sys.stderr)
        return 1
    print()
    return 0


def _generate_file(a: argparse.Namespace, defaults: dict) -> int:
    import signal

    from slipstream.cli.batch_job import check_paths, done_ids, read_jsonl, run_job
    from slipstream.cli.engine_setup import load_llm

    check_paths(a.input, a.output)
    if a.resume and not a.output:
        print("error: --resume needs --output", file=sys.stderr)
        return 2
    jobs = read_jsonl(a.input, defaults, a.chat, chat_defaults(a))
    skip = done_ids(a.output) if a.resume else set()
    llm = load_llm(engine_kwargs(a))
    f = open(a.output, "a" if a.resume else "w", encoding="utf-8") if a.output else sys.stdout
    if a.resume and a.output and not _ends_with_newline(a.output):
        f.write("\n")  # a line cut off by a crash stays alone (and its request runs again)

    def write(row: dict) -> None:
        f.write(json.dumps(row, ensure_ascii=False) + "\n")
        f.flush()

    def on_term(signum, frame):
        raise KeyboardInterrupt

    bar = None
    todo = sum(1 for j in jobs if j.id not in skip)
    if not a.quiet and a.output:
        from tqdm import tqdm
        bar = tqdm(total=todo, desc="generating", unit="req")
    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        counts = run_job(llm, jobs, write, skip, on_result=bar.update if bar else None)
    except KeyboardInterrupt:
        if bar:
            bar.close()
        print(f"interrupted: the finished results are in {a.output or 'stdout'}; "
              f"run again with --resume to finish the rest", file=sys.stderr)
        return 130
    except OSError as e:  # e.g. the disk is full (/dev/full)
        print(f"error: could not write the results to {a.output or 'stdout'}: {e.strerror or e}",
              file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        if a.output:
            try:
                f.close()
            except OSError:  # (the error above was reported; what was written stays)
                pass
    if bar:
        bar.close()
    skipped = f", {len(skip & {j.id for j in jobs})} already done" if skip else ""
    print(f"wrote {counts.ok + counts.failed} results to {a.output or 'stdout'}: {counts.ok} ok, "
          f"{counts.failed} failed{skipped}", file=sys.stderr)
    if counts.not_run:
        print(f"error: the engine failed ({llm.dead_error}); {counts.not_run} requests did not run"
              + ("; run again with --resume to run them" if a.output else ""), file=sys.stderr)
        return 1
    return 0


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as g:
        g.seek(0, 2)
        if g.tell() == 0:
            return True
        g.seek(-1, 2)
        return g.read(1) == b"\n"


def _generate_workload(a: argparse.Namespace) -> int:
    """Run a named benchmark workload (e.g. seed-8b-short) through the offline API."""
    import time

    from slipstream.bench.workloads import get_workload
    from slipstream.utils.process import freeze_gc
    from slipstream.frontend.llm import LLM

    workload = get_workload(a.workload)
    llm = LLM(**workload_engine_kwargs(a, workload))
    freeze_gc()
    start = time.perf_counter()
    outs = llm.generate(workload.prompts, workload.params, use_tqdm=not a.quiet)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    mode = "async" if llm.engine.async_scheduling else "sync"
    print(f"{workload.name}: {len(outs)} requests, {tokens} output tokens in {wall:.2f} s "
          f"({tokens / wall:,.0f} tok/s, {mode})")
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from slipstream.bench.run import run_bench
    from slipstream.bench.workloads import get_workload
    workload = get_workload(a.workload)
    return run_bench(a, workload, workload_engine_kwargs(a, workload, BENCH_ENGINE_DEFAULTS))


def build_parser() -> argparse.ArgumentParser:
    """The parser of every sub-command but `bench serve` (which parses its own flags)."""
    parser = argparse.ArgumentParser(prog="slipstream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for a prompt, or for a JSONL file of prompts")
    g.add_argument("prompt", nargs="?", default=None)
    g.add_argument("--chat", action="store_true", help="wrap prompts in the model's chat template")
    g.add_argument("--input", default=None, help="JSONL: {\"prompt\": ...} or {\"messages\": [...]} per line "
                                               "(with --ray: JSONL or Parquet, rows as ray.data.llm has them)")
    g.add_argument("--output", default=None, help="JSONL results (default: stdout)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument("--resume", action="store_true",
                   help="with --input/--output: skip ids already in the output (error rows too), append the rest")
    g.add_argument("--workload", default=None,
                   help="run a benchmark workload (seed-8b, seed-8b-short, small-256, moe-30b-a3b, tiny; "
                        "latency: seed-8b-bs1, seed-8b-bs8, small-bs1, moe-30b-a3b-bs1/-bs8/-bs64); "
                        "without --model, on its architecture with dummy weights")
    _ray_job_args(g)
    engine_args(g)
    _sampling_args(g)
    chat_args(g)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="run a named workload, sync vs async, and report throughput "
                                     "(`slipstream bench serve --help`: the serving load generator)")
    b.add_argument("--workload", default="seed-8b-short",
                   help="seed-8b | seed-8b-short | small-256 | moe-30b-a3b | tiny; latency (also ms per "
                        "step): seed-8b-bs1 | seed-8b-bs8 | small-bs1 | moe-30b-a3b-bs1 | -bs8 | -bs64")
    b.add_argument("--mode", default="both", choices=["sync", "async", "both"])
    b.add_argument("--out", default=None, help="folder for results JSON, Chrome trace and PNG timeline")
    b.add_argument("--num-requests", type=int, default=None, help="only the first N requests")
    b.add_argument("--grammar-tokenizer", default=None, metavar="SOURCE",
                   help="a model folder or GGUF file whose tokenizer gives constrained workloads their "
                        "vocabulary under dummy weights (default: the embedded SmolLM2)")
    b.add_argument("--no-measure", action="store_true",
                   help="use the recorded H200 ceilings (on another GPU, wall/floor is then against the H200's floor)")
    b.add_argument("--spec-synthetic-accept", type=float, default=None, metavar="A",
                   help="benchmark only, with --speculative-config: every verification step accepts the "
                        "first min(A, drafted) drafts whatever the model says and every row drafts k, so "
                        "tokens/s at A + 1 tokens a step can be measured with dummy weights (a fraction: "
                        "floor(A) + 1 on that share of the steps; the run is "
                        "labelled 'synthetic acceptance'; its tokens are not the model's)")
    engine_args(b, BENCH_ENGINE_DEFAULTS)
    b.set_defaults(func=cmd_bench)

    from slipstream.cli.serve import add_run_batch_parser, add_serve_parser
    add_serve_parser(sub, engine_args)
    add_run_batch_parser(sub, engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["bench", "serve"]:  # the serving load generator has flags of its own
        from slipstream.bench.serve import main as bench_serve
        return bench_serve(argv[2:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while the model loads (a job's own handler says more)
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
