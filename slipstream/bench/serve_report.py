"""The report side of `slipstream bench serve` (slipstream/bench/serve.py sends the requests):
the metrics computed from the per-request results, the printed block, the sweep table, the
PNG plot and the --save-result JSON.

The definitions follow `vllm bench serve` (SGLang's bench_serving agrees), so the numbers
compare with theirs:

* TTFT: from the POST to the first chunk that carries content (non-empty `text`, or
  `delta.content` on the chat endpoint, or, from a model without a tokenizer, non-empty
  `token_ids`);
* ITL: the gaps between consecutive content chunks. A chunk that carries several tokens
  counts as one gap, as in vLLM, so a server that batches tokens into chunks shows
  fewer, longer ITLs while its TPOT is unchanged;
* E2EL: from the POST to the last content chunk;
* TPOT of a request: (E2EL − TTFT) / (output tokens − 1), requests of one token left out;
* output tokens: `usage.completion_tokens` of the final chunk (`stream_options:
  {include_usage: true}`); without a usage chunk, the number of content chunks;
* request and token throughput: over the run's duration (first arrival to last reply);
  peak output throughput: the most tokens in any 1-second window, a chunk's tokens
  spread evenly over its request's chunks;
* goodput: requests per second that met every SLO given with --goodput.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone

from slipstream.bench.serve_datasets import ServeRequest

SLO_KEYS = ("ttft", "tpot", "e2el")
METRICS = {"ttft": ("Time to First Token", "TTFT"),
           "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
           "itl": ("Inter-token Latency", "ITL"),
           "e2el": ("End-to-end Latency", "E2EL")}


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    out = {}
    for item in items or []:
        key, sep, val = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput takes KEY:MS with KEY in {SLO_KEYS}, got {item!r}")
        if float(val) <= 0:
            raise ValueError(f"--goodput {key} must be > 0 ms, got {val}")
        out[key] = float(val)
    return out


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    start: float = 0.0  # perf_counter at the POST
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of content chunks
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from usage
    text: str = ""


def peak_tokens_per_s(ok: list[RequestResult]) -> float:
    """Most output tokens in any 1-second window (each chunk weighted by its share)."""
    events = sorted((t, r.output_tokens / len(r.chunk_times)) for r in ok for t in r.chunk_times)
    best = acc = 0.0
    lo = 0
    for t, w in events:
        acc += w
        while events[lo][0] <= t - 1.0:
            acc -= events[lo][1]
            lo += 1
        best = max(best, acc)
    return best


def peak_concurrency(ok: list[RequestResult]) -> int:
    """Most successful requests in flight at once (POST to last content chunk)."""
    edges = sorted([(r.start, 1) for r in ok] + [(r.start + r.e2e, -1) for r in ok],
                   key=lambda e: (e[0], e[1]))  # an end before a start at the same time
    best = cur = 0
    for _, d in edges:
        cur += d
        best = max(best, cur)
    return best


def compute_metrics(results: list[RequestResult], requests: list[ServeRequest],
                    duration: float, goodput: dict[str, float],
                    percentiles: list[float]) -> dict:
    import numpy as np

    ok = [r for r in results if r.success]
    in_lens = [(r.prompt_tokens if r.prompt_tokens is not None else (q.prompt_len or 0))
               if r.success else 0 for r, q in zip(results, requests)]
    out_lens = [r.output_tokens if r.success else 0 for r in results]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [g for r in ok for g in r.itl]
    e2els = [r.e2e for r in ok]
    total_in, total_out = sum(in_lens), sum(out_lens)
    good = 0
    for r in ok:
        tpot = (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        vals = {"ttft": r.ttft, "tpot": tpot, "e2el": r.e2e}
        good += all(vals[k] * 1000 <= ms for k, ms in goodput.items())
    m = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if goodput else None,
        "output_throughput": total_out / duration,
        "max_output_tokens_per_s": peak_tokens_per_s(ok),
        "max_concurrent_requests": peak_concurrency(ok),
        "total_token_throughput": (total_in + total_out) / duration,
    }
    for key, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        a = np.asarray(vals, dtype=np.float64) * 1000
        m[f"mean_{key}_ms"] = float(a.mean()) if a.size else 0.0
        m[f"median_{key}_ms"] = float(np.median(a)) if a.size else 0.0
        m[f"std_{key}_ms"] = float(a.std()) if a.size else 0.0
        for p in percentiles:
            m[f"p{p:g}_{key}_ms"] = float(np.percentile(a, p)) if a.size else 0.0
    t0 = min((r.start for r in results), default=0.0)
    m.update(input_lens=in_lens, output_lens=out_lens,
             ttfts=[r.ttft if r.success else None for r in results],
             itls=[r.itl for r in results],
             e2els=[r.e2e if r.success else None for r in results],
             start_times=[r.start - t0 for r in results],
             errors=[r.error for r in results])
    return m


def format_block(m: dict, percentiles: list[float], selected: list[str],
                 max_concurrency: int | None = None) -> str:
    """The result block, laid out as `vllm bench serve` prints it."""
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]

    def row(label, value, fmt=""):
        lines.append("{:<40} {:<10{}}".format(label, value, fmt))

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if max_concurrency:
        row("Maximum request concurrency:", max_concurrency)
    row("Benchmark duration (s):", m["duration"], ".2f")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"], ".2f")
    if m.get("request_goodput") is not None:
        row("Request goodput (req/s):", m["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", m["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", m["max_concurrent_requests"])
    row("Total Token throughput (tok/s):", m["total_token_throughput"], ".2f")
    for key in selected:
        title, short = METRICS[key]
        lines.append("{:-^50}".format(title))
        row(f"Mean {short} (ms):", m[f"mean_{key}_ms"], ".2f")
        row(f"Median {short} (ms):", m[f"median_{key}_ms"], ".2f")
        for p in percentiles:
            row(f"P{p:g} {short} (ms):", m[f"p{p:g}_{key}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(line.rstrip() for line in lines)


def format_sweep_table(runs: list[dict]) -> str:
    head = ("concurrency", "req/s", "out tok/s", "peak tok/s", "TTFT p50", "TTFT p99",
            "TPOT p50", "TPOT p99", "ITL p50", "E2EL p50", "failed")
    lines = ["{:>11} {:>8} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>6}".format(*head)]
    for r in runs:
        lines.append("{:>11} {:>8.2f} {:>10.1f} {:>10.1f} {:>9.1f} {:>9.1f} {:>9.2f} {:>9.2f} "
                     "{:>9.2f} {:>9.1f} {:>6}".format(
                         r["max_concurrency"], r["request_throughput"], r["output_throughput"],
                         r["max_output_tokens_per_s"], r["median_ttft_ms"],
                         r.get("p99_ttft_ms", 0.0), r["median_tpot_ms"],
                         r.get("p99_tpot_ms", 0.0), r["median_itl_ms"], r["median_e2el_ms"],
                         r["failed"]))
    lines.append("(latencies in ms)")
    return "\n".join(lines)


def plot_sweep(runs: list[dict], path: str, title: str) -> None:
    """Median TPOT and median TTFT against output throughput, one point per concurrency."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["output_throughput"] for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((axes[0], "median_tpot_ms", "median TPOT (ms)"),
                           (axes[1], "median_ttft_ms", "median TTFT (ms)")):
        y = [r[key] for r in runs]
        ax.plot(x, y, "o-")
        for xi, yi, r in zip(x, y, runs):
            ax.annotate(f"c={r['max_concurrency']}", (xi, yi), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("slipstream")
    except Exception:  # not installed: the package's own string
        from slipstream.version import __version__
        return __version__


def save_result(args, argv: list[str], runs: list[dict], model: str, rate, goodput: dict,
                sweep: list) -> str:
    """Write the --save-result JSON (the run's settings, then one run or a sweep's runs);
    return its path."""
    stamp = datetime.now(timezone.utc)
    doc = {"date": stamp.isoformat(timespec="seconds"), "slipstream_version": _version(),
           "argv": list(argv), "args": {k: v for k, v in vars(args).items()},
           "base_url": args.base_url, "endpoint": args.endpoint, "model": model,
           "dataset": args.dataset, "request_rate": rate, "burstiness": args.burstiness,
           "goodput_slos_ms": goodput}
    doc["args"]["request_rate"] = rate
    if args.api_key:  # never write the key into a result file
        doc["args"]["api_key"] = "<redacted>"
        doc["argv"] = ["<redacted>" if x == args.api_key else
                       ("--api-key=<redacted>" if x.startswith("--api-key=") else x)
                       for x in doc["argv"]]
    if args.concurrency:
        doc["runs"] = runs
    else:
        doc.update(runs[0])
    name = args.result_file or "serve-{}-{}qps-c{}-{}.json".format(
        os.path.basename(args.dataset).removesuffix(".jsonl"), rate,
        args.concurrency.replace(",", "_") if args.concurrency else sweep[0],
        stamp.strftime("%Y%m%d-%H%M%S"))
    path = name if os.path.isabs(name) else os.path.join(args.result_dir, name)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return path
