"""`slipstream bench`: one workload, sync and async in one process, side by side."""
from __future__ import annotations

import os
import platform
import time

import torch

from slipstream.bench.report import write_json
from slipstream.bench.throughput import (COPY_BANDWIDTH, MATMUL_RATE, RunResult, add_prompt, breakdown_table,
                                         measure_ceilings, recorded_ceilings, result_dict, run_until_done,
                                         run_workload)
from slipstream.config import EngineConfig
from slipstream.core.engine_core import EngineCore
from slipstream.utils.process import freeze_gc
from slipstream.sampling.params import SamplingParams


def environment() -> dict:
    import transformers
    env = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def seconds_since_process_start() -> float | None:
    """Wall seconds since this process started (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def bench_engine(a, workload, engine_options: dict) -> tuple[EngineCore, float]:
    """The EngineCore of a bench run of `workload` (cut to --num-requests) under `engine_options`
    (EngineConfig keywords; `a`: bench's other flags: the grammar tokenizer of a constrained
    workload, --spec-synthetic-accept), and its start time in seconds."""
    if a.num_requests:
        workload.prompts = workload.prompts[:a.num_requests]
        workload.params = workload.params[:a.num_requests]
    config = EngineConfig(**engine_options)
    t0 = time.perf_counter()
    constrained = sum(p.structured_outputs is not None for p in workload.params)
    engine = EngineCore(config, grammar_tokenizer=bench_grammar_tokenizer(a.grammar_tokenizer)
                        if constrained else None)
    init_s = time.perf_counter() - t0
    synthetic = a.spec_synthetic_accept
    if synthetic is not None:
        engine.set_bench_synthetic_acceptance(synthetic)
        print(f"SYNTHETIC ACCEPTANCE: every verification accepts min({synthetic}, drafted) drafts whatever "
              "the model says; the tokens are not the model's (a cost measurement)")
    return engine, init_s


def warm_up_tokens(workload, speculative: bool) -> list[int]:
    """New tokens a request of `workload` runs in the warm-up (`warm_up`)."""
    if speculative and workload.latency:
        return [p.max_tokens for p in workload.params]
    if any(p.structured_outputs is not None for p in workload.params):
        return [2 + i for i in range(len(workload.params))]
    return [2] * len(workload.params)


def warm_up(engine, workload) -> None:
    """Every prompt of `workload`, 2 tokens each unless `warm_up_tokens` says more, so the
    timed runs meet the same prefill batch shapes with their kernels compiled and cuBLAS plans
    chosen (otherwise the first mode run pays for it).
    Graphs captured at a shape's first use are met in the warm-up too, so the timed runs replay
    them, as a server does once it has run a while, and as plain decoding's graphs (captured
    at start) are: a constrained workload's decode graphs (runner/split_graphs.py) by warm-up
    requests that end one step apart (the batch shrinks through every decode size); a
    speculative latency workload's verify and drafting graphs (runner/verify_graphs.py, one a
    decode split count among others) by its requests run to their full length."""
    speculative = engine.config.speculative_config is not None
    for i, (prompt, p, n) in enumerate(zip(workload.prompts, workload.params, warm_up_tokens(workload, speculative))):
        add_prompt(engine, f"warm-up-{i}", prompt,  # (a grammar compiles here, once)
                   SamplingParams(max_tokens=n, temperature=p.temperature,
                                  ignore_eos=True, structured_outputs=p.structured_outputs))
    run_until_done(engine)


def run_bench(a, workload, engine_options: dict) -> int:
    """`workload` under `engine_options` (EngineConfig keywords); `a`: bench's other flags."""
    engine, init_s = bench_engine(a, workload, engine_options)
    config, synthetic = engine.config, a.spec_synthetic_accept
    constrained = sum(p.structured_outputs is not None for p in workload.params)
    ready_s = seconds_since_process_start()
    ready = f"; process start to ready {ready_s:.2f} s" if ready_s is not None else ""
    print(f"engine start: {init_s:.2f} s ({', '.join(f'{k} {v}' for k, v in engine.startup.items())}){ready}")
    gpu, bandwidth, rate = "H200", COPY_BANDWIDTH, MATMUL_RATE
    tp = config.tensor_parallel_size
    measured = engine.device.type == "cuda" and not a.no_measure and tp == 1  # (GPU 0 is a rank's under TP)
    if measured:
        bandwidth, rate = measure_ceilings(engine.device)
    elif engine.device.type == "cuda":
        gpu, bandwidth, rate = recorded_ceilings(torch.cuda.get_device_name(engine.device))
    bandwidth, rate = bandwidth * tp, rate * tp  # the floor of a step over tp GPUs (no all-reduce)
    warm_up(engine, workload)
    freeze_gc()

    modes = ["sync", "async"] if a.mode == "both" else [a.mode]
    results: dict[str, RunResult] = {}
    timelines, outputs = {}, {}
    for mode in modes:
        results[mode], timelines[mode], outs = run_workload(engine, workload, mode, bandwidth, rate)
        outputs[mode] = outs
    summary = {"workload": workload.name, "env": environment(), "engine_init_s": init_s,
               "engine_startup": engine.startup, "process_to_ready_s": ready_s,
               "engine_options": dict(engine_options, max_num_batched_tokens=engine.max_num_batched_tokens),
               "copy_bandwidth": bandwidth, "matmul_rate": rate, "ceilings_measured": measured,
               "kv_blocks": engine.pool.num_blocks,
               "results": {m: result_dict(r) for m, r in results.items()}}
    if synthetic is not None:
        summary["synthetic_acceptance"] = synthetic
        for m in summary["results"].values():
            if m.get("speculation"):
                m["speculation"]["synthetic_acceptance"] = synthetic
    if len(modes) == 2:
        same = outputs["sync"] == outputs["async"]
        summary["speedup"] = results["sync"].wall_s / results["async"].wall_s
        summary["identical_outputs"] = same
    print(RunResult.header(ms_per_step=workload.latency))  # latency workloads: + ms per step
    for r in results.values():
        print(r.row(ms_per_step=workload.latency))
    for mode, r in results.items():
        print(f"{mode}: garbage-collector pauses " + (", ".join(
            f"{g} {v['count']} x, {v['total_ms']:.1f} ms, longest {v['max_ms']:.1f} ms" for g, v in r.gc_pauses.items())
            or "none"))
    for mode, r in results.items():
        if r.speculation:
            s = r.speculation
            label = f" (SYNTHETIC ACCEPTANCE {synthetic})" if synthetic is not None else ""
            print(f"{mode}: speculation{label}: {s['drafted']} drafts, {s['accepted']} accepted "
                  f"({100 * s['acceptance_rate']:.1f}%), {s['mean_accepted_length']:.2f} tokens a drafting "
                  f"row-step, drafts in {s['steps_with_drafts']} of {s['steps']} steps")
    if constrained:
        stats = engine.stats()
        summary["structured_outputs"] = grammar_summary(timelines, constrained, stats)
        for mode, tl in timelines.items():
            print(f"{mode}: {grammar_line(tl, constrained, len(workload.params))}")
        print(compile_line(stats))
    for mode, r in results.items():
        if r.breakdown:
            print(f"\n{mode}: where the GPU time goes\n{breakdown_table(r.breakdown)}")
    if "speedup" in summary:
        print(f"async speedup {summary['speedup']:.3f}x; identical outputs: {summary['identical_outputs']}")
    print(f"{ceilings_line(bandwidth, rate, measured, gpu)}; env {summary['env']}")
    if a.out:
        _write(a.out, workload.name, summary, timelines)
    return 0


def bench_grammar_tokenizer(source: str | None = None):
    """The tokenizer structured outputs read their vocabulary from under dummy weights: `source`'s
    (a folder or GGUF file), by default the embedded SmolLM2's (the backend pads it to the
    model's vocabulary with tokens never allowed)."""
    from slipstream.model.loader import resolve_model_source
    from slipstream.model.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(resolve_model_source(source))
    if tokenizer is None:
        raise ValueError(f"--grammar-tokenizer {source!r} has no tokenizer files")
    return tokenizer.hf


def grammar_line(timeline, constrained: int, total: int) -> str:
    """The CPU time of the step loop's "grammar" spans: the matchers' bitmasks of constrained
    batches and their sampling launches (the matchers' token accepts are in "process")."""
    per_step, steps = grammar_ms_per_step(timeline)
    return (f"{constrained} of {total} requests constrained; grammar CPU {per_step:.3f} ms per "
            f"constrained step over {steps} steps")


def grammar_ms_per_step(timeline) -> tuple[float, int]:
    """The mean CPU milliseconds of the timeline's "grammar" spans, and their count."""
    spans = [s.end - s.start for s in timeline.spans if s.name == "grammar"] if timeline else []
    return (1e3 * sum(spans) / len(spans) if spans else 0.0), len(spans)


def compile_line(stats: dict) -> str:
    """The grammar compiles of the run (EngineCore.stats): the cold ones (the warm-up's, one per
    schema) and the cache hits of every later request."""
    n = stats.get("grammar_compiled", 0)
    cold = 1e3 * stats.get("grammar_compile_seconds", 0.0) / n if n else 0.0
    return (f"grammar compile: {n} cold, {cold:.1f} ms each; {stats.get('grammar_cache_hits', 0)} cache hits, "
            f"{stats.get('grammar_compile_failed', 0)} failed")


def grammar_summary(timelines: dict, constrained: int, stats: dict) -> dict:
    """The structured-output figures of the bench's JSON summary."""
    per_mode = {mode: dict(zip(("grammar_cpu_ms_per_step", "constrained_steps"), grammar_ms_per_step(tl)))
                for mode, tl in timelines.items()}
    keys = ("grammar_compiled", "grammar_compile_seconds", "grammar_cache_hits", "grammar_compile_failed")
    return {"constrained_requests": constrained, "modes": per_mode, **{k: stats.get(k) for k in keys}}


def ceilings_line(bandwidth: float, rate: float, measured: bool, gpu: str = "H200") -> str:
    """The floor's ceilings, saying where they come from: unmeasured ones are those recorded
    for `gpu` (bench/throughput.py, RECORDED_CEILINGS)."""
    source = "measured on this GPU" if measured else f"the {gpu}'s recorded ones, not measured here"
    return f"ceilings ({source}): copy {bandwidth / 1e12:.2f} TB/s, matmul {rate / 1e12:.0f} TFLOP/s"


def _write(out: str, name: str, summary: dict, timelines: dict) -> None:
    from slipstream.core.tracing import write_chrome_trace
    write_json(out, f"{name}.json", summary)
    write_chrome_trace(os.path.join(out, f"{name}.trace.json"),
                       {mode: tl.middle(300) for mode, tl in timelines.items()})
    try:
        from slipstream.bench.plot import plot_timelines
        plot_timelines(timelines, os.path.join(out, f"{name}.png"), title=f"{name}: sync (top) vs async")
    except ImportError:
        print("matplotlib is not installed: no PNG timeline")
