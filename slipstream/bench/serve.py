"""`slipstream bench serve`: a load generator for OpenAI-compatible streaming servers.

This file sends the requests: the streaming client that times each content chunk, the
arrival schedule, the run loop (one event loop or --num-workers processes) and `main(argv)`.
serve_report.py computes the metrics (`vllm bench serve`'s definitions)
from the per-request results, and prints, plots and saves them.

A request fails on an HTTP error, an `{"error": ...}` event in the stream, a transport
error or a stream without content; failures are counted and their errors kept.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time

from slipstream.bench.serve_datasets import ServeRequest, load_requests
from slipstream.bench.serve_report import (METRICS, RequestResult, compute_metrics, format_block,
                                           format_sweep_table, parse_goodput, plot_sweep, save_result)

try:  # a third of json.loads's time per chunk
    from msgspec.json import decode as _loads
except ImportError:
    _loads = json.loads


async def send_request(session, url: str, payload: dict, chat: bool,
                       headers: dict) -> RequestResult:
    """POST one streaming request and time its content chunks."""
    import aiohttp

    res = RequestResult()
    usage = None
    last = None
    parts = []
    res.start = time.perf_counter()
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                body = (await resp.text())[:1000]
                res.error = f"HTTP {resp.status}: {body}"
                return res
            buf = b""
            done = False
            # Read whatever has arrived and split it into SSE lines ourselves: aiohttp's
            # line iterator costs ~25 µs a line, which would make the client the
            # bottleneck near 30k tok/s. Lines read together share their arrival time.
            async for piece in resp.content.iter_any():
                now = time.perf_counter()
                lines = (buf + piece).split(b"\n")
                buf = lines.pop()  # an incomplete last line waits for the next read
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments, other fields
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    obj = _loads(data)
                    if obj.get("error"):
                        err = obj["error"]
                        res.error = "stream error: " + (
                            err.get("message", str(err)) if isinstance(err, dict) else str(err))
                        return res
                    if obj.get("usage"):
                        usage = obj["usage"]
                    choices = obj.get("choices")
                    if not choices:
                        continue
                    c = choices[0]
                    text = (c.get("delta") or {}).get("content") if chat else c.get("text")
                    if not text and c.get("token_ids"):  # a model without a tokenizer (dummy
                        text = " "                      # weights) streams token ids only
                    if not text:
                        continue
                    if last is None:
                        res.ttft = now - res.start
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.chunk_times.append(now)
                    parts.append(text)
                if done:
                    break
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError, AttributeError,
            TypeError, KeyError) as e:  # transport errors and malformed events
        res.error = f"{type(e).__name__}: {e}"
        return res
    if last is None:
        res.error = "the stream carried no content"
        return res
    res.text = "".join(parts)
    res.e2e = last - res.start
    res.output_tokens = int(usage["completion_tokens"]) if usage and usage.get(
        "completion_tokens") is not None else len(res.chunk_times)
    if usage and usage.get("prompt_tokens") is not None:
        res.prompt_tokens = int(usage["prompt_tokens"])
    res.success = True
    return res


def build_payload(req: ServeRequest, i: int, args, model: str) -> dict:
    """The JSON body of request i: streamed, usage included, seeded with seed + i."""
    temp = args.temperature if args.temperature is not None else (
        req.temperature if req.temperature is not None else 0.0)
    p = {"model": model, "stream": True, "stream_options": {"include_usage": True},
         "temperature": temp, "seed": args.seed + i}
    if is_chat(args):
        p["messages"] = [{"role": "user", "content": req.prompt}]
        if req.output_len is not None:
            p["max_completion_tokens"] = req.output_len
    else:
        p["prompt"] = req.prompt
        if req.output_len is not None:
            p["max_tokens"] = req.output_len
    if args.ignore_eos or req.ignore_eos:
        p["ignore_eos"] = True
    p.update(args.extra_body)
    return p


def is_chat(args) -> bool:
    return args.endpoint.rstrip("/").endswith("chat/completions")


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s from the start): all 0 for an infinite rate, else gamma-distributed
    gaps of mean 1/rate with shape `burstiness` (1: a Poisson process; below 1 burstier,
    above 1 more regular)."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, scale)
    return out


def _session(limit: int, timeout_s: float):
    import aiohttp

    # aiohttp's default connection limit of 100 would cap the concurrency silently.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max(1, limit)),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s),
                                 read_bufsize=1 << 20)


async def _drive(args, payloads: list[dict], offsets: list[float], t0: float,
                 max_concurrency: int | None, tick) -> tuple[list[RequestResult], float]:
    """Send each payload at t0 + its offset (perf_counter seconds), at most
    max_concurrency at a time; return the results in order and the time the last ended."""
    url = args.base_url.rstrip("/") + args.endpoint
    chat = is_chat(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with _session(max_concurrency or len(payloads), args.timeout) as session:

        async def one(i: int) -> RequestResult:
            delay = t0 + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                r = await send_request(session, url, payloads[i], chat, headers)
            else:
                async with sem:
                    r = await send_request(session, url, payloads[i], chat, headers)
            tick()
            return r

        results = await asyncio.gather(*(one(i) for i in range(len(payloads))))
        return list(results), time.perf_counter()


def _run_loop(coro):
    """Run a coroutine on uvloop when it is installed (cheaper per chunk), else asyncio."""
    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def _child(w, args, payloads, offsets, t0, mc, counter, queue) -> None:
    def tick():
        with counter.get_lock():
            counter.value += 1
    try:
        queue.put((w, "ok", _run_loop(_drive(args, payloads, offsets, t0, mc, tick))))
    except BaseException as e:  # report, never hang the parent
        queue.put((w, "error", f"{type(e).__name__}: {e}"))


def _progress(args, n: int):
    if args.disable_tqdm:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=n, file=sys.stderr)


def run_once(args, requests: list[ServeRequest], model: str,
             max_concurrency: int | None) -> tuple[list[RequestResult], float]:
    """Send every request on its arrival schedule; return the results and the duration.

    With --num-workers W > 1 the requests are dealt round-robin to W forked processes,
    each with its own event loop, connections and a W-th of the concurrency limit
    (one client loop parses ~25-40k chunks/s). Their clocks agree: perf_counter is
    CLOCK_MONOTONIC, one clock for every process on the machine."""
    import multiprocessing as mp

    payloads = [build_payload(r, i, args, model) for i, r in enumerate(requests)]
    offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, args.seed)
    if not args.skip_initial_test:
        async def test():
            async with _session(1, args.timeout) as session:
                return await send_request(session, args.base_url.rstrip("/") + args.endpoint,
                                          dict(payloads[0]), is_chat(args), {"Authorization":
                                          f"Bearer {args.api_key}"} if args.api_key else {})
        r = _run_loop(test())
        if not r.success:
            raise RuntimeError(f"the initial test request failed: {r.error}")
    n_workers = max(1, min(args.num_workers, len(requests), max_concurrency or len(requests)))
    if n_workers == 1:
        bar = _progress(args, len(requests))
        t0 = time.perf_counter()
        results, end = _run_loop(_drive(args, payloads, offsets, t0, max_concurrency,
                                        bar.update if bar else lambda *_: None))
        if bar is not None:
            bar.close()
        return results, end - t0
    ctx = mp.get_context("fork")
    counter, queue = ctx.Value("l", 0), ctx.Queue()
    t0 = time.perf_counter() + 0.2 + 0.02 * n_workers  # every child is up by then
    procs = []
    for w in range(n_workers):
        mc = None if not max_concurrency else (
            max_concurrency // n_workers + (w < max_concurrency % n_workers))
        procs.append(ctx.Process(target=_child, daemon=True, args=(
            w, args, payloads[w::n_workers], offsets[w::n_workers], t0, mc, counter, queue)))
        procs[-1].start()
    bar = _progress(args, len(requests))  # after the forks: tqdm may start a thread
    got: list = [None] * n_workers
    pending = n_workers
    try:
        while pending:
            try:
                w, status, value = queue.get(timeout=0.2)
            except Exception:  # queue.Empty: refresh the bar, check the children live
                if not any(p.is_alive() for p in procs) and queue.empty():
                    raise RuntimeError("a load-generator worker died") from None
            else:
                if status != "ok":
                    raise RuntimeError(f"a load-generator worker failed: {value}")
                pending -= 1
                got[w] = value
            if bar is not None:
                bar.update(counter.value - bar.n)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        if bar is not None:
            bar.close()
    results: list = [None] * len(requests)
    for w, (res, _) in enumerate(got):
        results[w::n_workers] = res
    return results, max(end for _, end in got) - t0


def _first_model(args) -> str:
    import urllib.request

    req = urllib.request.Request(args.base_url.rstrip("/") + "/v1/models")
    if args.api_key:
        req.add_header("Authorization", f"Bearer {args.api_key}")
    with urllib.request.urlopen(req, timeout=30) as f:
        data = json.load(f).get("data") or []
    if not data:
        raise RuntimeError("/v1/models lists no model; pass --model")
    return data[0]["id"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slipstream bench serve",
                                description="Load an OpenAI-compatible streaming server and "
                                            "report TTFT, TPOT, ITL, E2EL and throughput.")
    a = p.add_argument
    a("--base-url", default="http://127.0.0.1:8000")
    a("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    a("--model", default=None, help="default: the first model /v1/models lists")
    a("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    a("--dataset", default="random", help="random, small-256 or a FILE.jsonl")
    a("--num-prompts", type=int, default=None,
      help="default: 1000 for random, the whole set otherwise (cycled if larger)")
    a("--random-input-len", type=int, default=1024)
    a("--random-output-len", type=int, default=128)
    a("--random-range-ratio", type=float, default=0.0)
    a("--random-vocab-size", type=int, default=10000, help="token ids drawn below this")
    a("--request-rate", type=float, default=float("inf"), help="req/s; inf: all at once")
    a("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    a("--max-concurrency", type=int, default=None)
    a("--concurrency", default=None,
      help="a sweep: comma-separated max concurrencies, one run each (e.g. 1,8,32)")
    a("--prompts-per-concurrency", type=int, default=None,
      help="in a sweep, send at most this many prompts per unit of concurrency")
    a("--plot", default=None, help="write a PNG of median TPOT and TTFT against output throughput (one point a run)")
    a("--ignore-eos", action="store_true")
    a("--temperature", type=float, default=None,
      help="default 0 (small-256: its definition's 0.6)")
    a("--seed", type=int, default=0, help="prompts, arrivals; request i is sent seed+i")
    a("--extra-body", type=json.loads, default={}, help="JSON merged into every request")
    a("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs: ttft, tpot, e2el")
    a("--percentile-metrics", default="ttft,tpot,itl,e2el")
    a("--metric-percentiles", default="99")
    a("--save-result", action="store_true")
    a("--result-dir", default=".")
    a("--result-file", default=None)
    a("--timeout", type=float, default=6 * 3600.0, help="per request, seconds")
    a("--skip-initial-test", action="store_true",
      help="skip the single request sent first to check the server answers")
    a("--num-workers", type=int, default=1,
      help="client processes sharing the load (one loop parses ~25-40k chunks/s)")
    a("--disable-tqdm", action="store_true")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        goodput = parse_goodput(args.goodput)
        percentiles = [float(x) for x in args.metric_percentiles.split(",") if x.strip()]
        selected = [k.strip() for k in args.percentile_metrics.split(",") if k.strip()]
        if bad := [k for k in selected if k not in METRICS]:
            raise ValueError(f"unknown --percentile-metrics {bad}; known: {list(METRICS)}")
        sweep = ([int(c) for c in args.concurrency.split(",")] if args.concurrency
                 else [args.max_concurrency])
        if any(c is not None and c < 1 for c in sweep):
            raise ValueError("concurrency values must be >= 1")
        requests = load_requests(args)
        if not requests:
            raise ValueError("no requests to send (--num-prompts 0?)")
        if is_chat(args) and any(not isinstance(r.prompt, str) for r in requests):
            raise ValueError("the chat endpoint needs text prompts; this dataset has token ids")
        model = args.model or _first_model(args)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"slipstream bench serve: {e}", file=sys.stderr)
        return 2
    rate = "inf" if math.isinf(args.request_rate) else args.request_rate
    runs = []
    for c in sweep:
        reqs = requests
        if args.concurrency and args.prompts_per_concurrency:
            reqs = requests[:args.prompts_per_concurrency * c]
        print(f"Model: {model}  dataset: {args.dataset}  prompts: {len(reqs)}")
        print(f"Traffic request rate: {rate}")
        print(f"Burstiness factor: {args.burstiness}"
              + (" (Poisson process)" if args.burstiness == 1 else ""))
        print(f"Maximum request concurrency: {c}")
        try:
            results, duration = run_once(args, reqs, model, c)
        except RuntimeError as e:
            print(f"slipstream bench serve: {e}", file=sys.stderr)
            return 1
        m = compute_metrics(results, reqs, duration, goodput, percentiles)
        print(format_block(m, percentiles, selected, c), flush=True)
        errors = [e for e in m["errors"] if e]
        for e in errors[:5]:
            print(f"failed request: {e}", file=sys.stderr)
        runs.append({"max_concurrency": c, "num_prompts": len(reqs), **m})
    if args.concurrency:
        print(format_sweep_table(runs))
    if args.save_result or args.result_file:
        path = save_result(args, argv, runs, model, rate, goodput, sweep)
        print(f"results: {path}")
    if args.plot:  # after saving: a missing matplotlib loses nothing
        try:
            plot_sweep(runs, args.plot, f"{model} · {args.dataset} · rate {rate}")
            print(f"plot: {args.plot}")
        except ImportError as e:
            print(f"slipstream bench serve: no plot ({e})", file=sys.stderr)
    return 0 if all(r["completed"] for r in runs) else 1
