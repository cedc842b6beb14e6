"""The grammar's CPU cost per step when the model draws uniformly among the allowed tokens,
as the constrained bench workloads do under dummy weights: `--rows` matchers of the bench
schema (BENCH_SCHEMA) each accept the token their row drew last step, then fill their bitmask
rows; each row then draws a random allowed token (not timed; the same draws for every setting).

`--workers 0` is the engine's in-process path (the accepts one at a time in this process,
the fill on the backend's batch threads); N > 0 is `--structured-outputs-workers N`: the rows
shared out among N grammar worker processes, one `Step` message each, their rows written into
the shared bitmask and copied into a pinned-like buffer, as `StructuredOutputs` does.  Prints
the median milliseconds a step of accept + fill (and its parts for N = 0) per setting.
`--backend` picks xgrammar or llguidance; `--stop` the model's stop ids (151645: the bench
model's EOS, Qwen3's, past SmolLM2's tokenizer, as small-256-json runs it).

    python benchmarks/probe_grammar_random.py --tokenizer .smoltok [--rows 256] [--steps 60]
        [--workers 0 1 2 4 8] [--vocab 151936] [--backend xgrammar] [--stop 0]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from slipstream.bench.run import bench_grammar_tokenizer
from slipstream.bench.workloads import BENCH_SCHEMA
from slipstream.sampling.grammar.backend import create_grammar_backend
from slipstream.sampling.grammar.bitmask import allocate_bitmask
from slipstream.sampling.grammar.compiler import GrammarCompiler
from slipstream.sampling.grammar.matcher import fill_bitmasks
from slipstream.sampling.grammar.worker_messages import Step
from slipstream.sampling.grammar.worker_pool import GrammarWorkerPool, GrammarWorkerSpec
from slipstream.sampling.structured import StructuredOutputsParams


def random_allowed(bitmask: torch.Tensor, vocab: int, gen: torch.Generator) -> list[int]:
    bits = ((bitmask[:, :, None] >> torch.arange(32)) & 1).reshape(bitmask.shape[0], -1)[:, :vocab]
    return torch.multinomial(bits.float() + 1e-12, 1, generator=gen)[:, 0].tolist()


class Draws:
    """Each step's tokens, drawn once (by the first setting) and replayed by the others."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.steps = vocab, []
        self.gen = torch.Generator().manual_seed(0)

    def after(self, step: int, bitmask: torch.Tensor) -> list[int]:
        if len(self.steps) <= step:
            self.steps.append(random_allowed(bitmask, self.vocab, self.gen))
        return self.steps[step]


def in_process(tok, a, draws: Draws) -> dict:
    backend = create_grammar_backend(a.backend, tok, a.vocab, a.stop)
    with GrammarCompiler(backend) as comp:
        handle = comp.submit(StructuredOutputsParams(json=BENCH_SCHEMA))
        matchers = [comp.new_matcher(handle) for _ in range(a.rows)]
    bitmask = allocate_bitmask(a.rows, a.vocab)
    accept, fill, tokens = [], [], None
    for step in range(a.steps):
        t0 = time.perf_counter()
        if tokens is not None:
            for m, t in zip(matchers, tokens):
                m.accept(t)
        t1 = time.perf_counter()
        fill_bitmasks(matchers, bitmask, list(range(a.rows)))
        t2 = time.perf_counter()
        accept.append(t1 - t0)
        fill.append(t2 - t1)
        tokens = draws.after(step, bitmask)
    total = [x + y for x, y in zip(accept[1:], fill[1:])]
    return {"step_ms_median": 1e3 * statistics.median(total),
            "accept_ms_median": 1e3 * statistics.median(accept[1:]),
            "fill_ms_median": 1e3 * statistics.median(fill[1:])}


def with_workers(tok, a, n: int, draws: Draws) -> dict:
    key = StructuredOutputsParams(json=BENCH_SCHEMA).key()
    pool = GrammarWorkerPool(GrammarWorkerSpec(a.backend, tok, a.vocab, tuple(a.stop)), n)
    t0 = time.perf_counter()
    owners = [pool.assign(row, key) for row in range(a.rows)]  # least loaded: round-robin
    while not all(pool.is_ready(w) for w in set(owners)):
        time.sleep(0.01)
    start_s = time.perf_counter() - t0
    pinned = allocate_bitmask(a.rows, a.vocab)
    shared = pool.bitmask(a.rows, pinned.shape[1])
    times, tokens = [], None
    for step in range(a.steps):
        t0 = time.perf_counter()
        messages = {w: Step([], [], [], "", 0, 0) for w in set(owners)}
        for row, w in enumerate(owners):
            if tokens is not None:
                messages[w].accepts.append((row, [tokens[row]]))
            messages[w].fills.append((row, row))
        errors = pool.step(messages)
        np.copyto(pinned.numpy(), shared[:a.rows].numpy())  # as StructuredOutputs does
        times.append(time.perf_counter() - t0)
        if errors:
            raise RuntimeError(f"workers reported errors: {list(errors.items())[:3]}")
        tokens = draws.after(step, pinned)
    pool.close()
    # the first step waits for the workers' compiles
    return {"step_ms_median": 1e3 * statistics.median(times[1:]), "workers_start_s": round(start_s, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the embedded SmolLM2's)")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--vocab", type=int, default=151936, help="the model's vocabulary (small-256's)")
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    ap.add_argument("--backend", default="xgrammar", choices=["xgrammar", "llguidance"])
    ap.add_argument("--stop", type=int, nargs="+", default=[0], help="the model's stop token ids")
    a = ap.parse_args()
    tok = bench_grammar_tokenizer(a.tokenizer)
    draws = Draws(a.vocab)
    out: dict = {"backend": a.backend, "rows": a.rows, "steps": a.steps, "vocab": a.vocab, "stop": a.stop}
    for n in a.workers:
        out[f"workers_{n}"] = in_process(tok, a, draws) if n == 0 else with_workers(tok, a, n, draws)
        print(f"workers {n}: {out[f'workers_{n}']}", flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
