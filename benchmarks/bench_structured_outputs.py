"""What structured outputs cost on the CPU (sampling/grammar/), with SmolLM2's tokenizer:

- the backend's build (xgrammar's tokenizer info for the 49k vocabulary);
- compiling a small JSON schema (a few fields and an array): cold (each compile from
  scratch) and cached (a GrammarCompiler.submit that hits the LRU cache, until ready);
- per decode step at `--rows` constrained rows, each in its own place in a JSON document:
  filling every row's bitmask and accepting one token per row, with the batch helpers
  (`fill_bitmasks` / `accept_tokens`: xgrammar's batch matcher over `--threads`) and with a
  loop over the rows (`GrammarMatcher.fill_bitmask` / `accept`).

    python benchmarks/bench_structured_outputs.py [--rows 256] [--steps 200] [--threads 1 2]

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from slipstream.model.tokenizer import load_tokenizer
from slipstream.sampling.grammar.bitmask import allocate_bitmask
from slipstream.sampling.grammar.compiler import GrammarCompiler
from slipstream.sampling.grammar.matcher import GrammarMatcher, accept_tokens, fill_bitmasks
from slipstream.sampling.grammar.xgrammar_backend import XGrammarBackend
from slipstream.sampling.structured import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["name", "age", "email", "active", "tags"],
}


def document(i: int) -> str:
    return json.dumps({"name": f"User number {i}", "age": i % 150,
                       "email": f"user{'x' * (i % 7)}@mail.com", "active": i % 2 == 0,
                       "tags": ["alpha", "beta", f"tag {i}"][: i % 4]})


def compile_times(backend: XGrammarBackend, repeats: int) -> dict:
    params = StructuredOutputsParams(json=SCHEMA)
    cold = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.compile(params.key())  # xgrammar's own cache is off: every compile is cold
        cold.append(time.perf_counter() - start)
    with GrammarCompiler(backend) as compiler:
        compiler.submit(params).result()
        cached = []
        for _ in range(repeats):
            start = time.perf_counter()
            handle = compiler.submit(StructuredOutputsParams(json=SCHEMA))
            handle.result()
            cached.append(time.perf_counter() - start)
    return {"cold_ms_median": 1e3 * statistics.median(cold), "cold_ms_min": 1e3 * min(cold),
            "cached_us_median": 1e6 * statistics.median(cached)}


class Rows:
    """`count` matchers, each walking its own document from its own starting offset; a row that
    reaches its document's end starts over (outside the timed calls)."""

    def __init__(self, backend, compiled, tokenizer, count: int):
        self.backend, self.compiled = backend, compiled
        self.docs = [tokenizer.encode(document(i)) + [2] for i in range(count)]
        self.matchers = []
        for i, ids in enumerate(self.docs):
            matcher = GrammarMatcher(backend, compiled)
            matcher.accept_many(ids[: i % (len(ids) - 1)])
            self.matchers.append(matcher)

    def next_tokens(self) -> list[int]:
        for i, matcher in enumerate(self.matchers):
            if matcher.num_accepted == len(self.docs[i]):
                self.matchers[i] = GrammarMatcher(self.backend, self.compiled)
        return [self.docs[i][m.num_accepted] for i, m in enumerate(self.matchers)]


def step_times(backend, compiled, tokenizer, rows: int, steps: int, batched: bool) -> dict:
    state = Rows(backend, compiled, tokenizer, rows)
    bitmask = allocate_bitmask(rows, backend.vocab_size)
    row_ids = list(range(rows))
    fill, accept = [], []
    for _ in range(steps):
        tokens = state.next_tokens()
        start = time.perf_counter()
        if batched:
            fill_bitmasks(state.matchers, bitmask, row_ids)
        else:
            for row, matcher in enumerate(state.matchers):
                matcher.fill_bitmask(bitmask, row)
        middle = time.perf_counter()
        if batched:
            ok = accept_tokens(state.matchers, tokens)
        else:
            ok = [m.accept(t) for m, t in zip(state.matchers, tokens)]
        end = time.perf_counter()
        assert all(ok)
        fill.append(middle - start)
        accept.append(end - middle)
    return {"fill_ms_median": 1e3 * statistics.median(fill),
            "fill_ms_mean": 1e3 * statistics.fmean(fill),
            "fill_ms_p90": 1e3 * sorted(fill)[int(0.9 * steps)],
            "accept_ms_median": 1e3 * statistics.median(accept),
            "accept_ms_mean": 1e3 * statistics.fmean(accept)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()

    tokenizer = load_tokenizer(None)
    stop_ids = sorted(tokenizer.eos_token_ids)
    start = time.perf_counter()
    backend = XGrammarBackend(tokenizer.hf, tokenizer.vocab_size, stop_ids)
    result = {"cpus": os.cpu_count(), "rows": args.rows, "steps": args.steps,
              "backend_build_s": time.perf_counter() - start,
              "compile": compile_times(backend, args.repeats)}
    compiled = backend.compile(StructuredOutputsParams(json=SCHEMA).key())
    result["per_step_loop"] = step_times(backend, compiled, tokenizer, args.rows, args.steps,
                                         batched=False)
    for threads in args.threads:
        threaded = XGrammarBackend(tokenizer.hf, tokenizer.vocab_size, stop_ids,
                                   batch_threads=threads)
        result[f"per_step_batch_{threads}_threads"] = step_times(
            threaded, threaded.compile(StructuredOutputsParams(json=SCHEMA).key()), tokenizer,
            args.rows, args.steps, batched=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
