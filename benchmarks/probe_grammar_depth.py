"""A constrained row's grammar cost as its output grows, per backend: `--rows` matchers of the
bench schema (BENCH_SCHEMA, the constrained workloads' vocabulary) draw uniformly among their
allowed tokens, as the bench's dummy weights do, for `--steps` steps; per block of 100 steps it
prints the mean microseconds a row of the bitmask fill (one thread) and of the token accept.

    python benchmarks/probe_grammar_depth.py [--backends xgrammar llguidance] [--rows 16]
        [--steps 300] [--tokenizer SOURCE] [--vocab 151936] [--stop 0]

`--stop`: the model's stop ids (151645, Qwen3's EOS, lies past SmolLM2's tokenizer, as in the
constrained bench workloads).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from probe_grammar_random import random_allowed  # noqa: E402

from slipstream.bench.run import bench_grammar_tokenizer  # noqa: E402
from slipstream.bench.workloads import BENCH_SCHEMA  # noqa: E402
from slipstream.sampling.grammar.backend import create_grammar_backend  # noqa: E402
from slipstream.sampling.grammar.bitmask import allocate_bitmask  # noqa: E402
from slipstream.sampling.structured import GrammarKey  # noqa: E402


def probe(name: str, tok, a) -> list[tuple[int, float, float]]:
    backend = create_grammar_backend(name, tok, a.vocab, a.stop, batch_threads=1)
    compiled = backend.compile(GrammarKey("json", json.dumps(BENCH_SCHEMA), False))
    matchers = [backend.new_matcher(compiled) for _ in range(a.rows)]
    bitmask = allocate_bitmask(a.rows, a.vocab)
    gen = torch.Generator().manual_seed(1)
    per_step = []
    for _ in range(a.steps):
        live = [i for i, m in enumerate(matchers) if not m.is_terminated()]
        if not live:
            break
        t = time.perf_counter()
        backend.fill_bitmasks([matchers[i] for i in live], bitmask, live)
        fill = (time.perf_counter() - t) / len(live)
        draws = random_allowed(bitmask, a.vocab, gen)
        t = time.perf_counter()
        for i in live:
            if not matchers[i].accept_token(draws[i]):
                raise SystemExit(f"{name}: a token drawn under the row's bitmask was rejected")
        per_step.append((fill, (time.perf_counter() - t) / len(live)))
    return [(start, 1e6 * statistics.mean(f for f, _ in per_step[start:start + 100]),
             1e6 * statistics.mean(x for _, x in per_step[start:start + 100]))
            for start in range(0, len(per_step), 100)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", nargs="+", default=["xgrammar", "llguidance"])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--stop", type=int, nargs="+", default=[0], help="the model's stop token ids")
    a = ap.parse_args()
    tok = bench_grammar_tokenizer(a.tokenizer)
    print("| backend | steps | fill us a row | accept us a row |\n|---|---|---|---|")
    for name in a.backends:
        for start, fill, accept in probe(name, tok, a):
            print(f"| {name} | {start}-{start + 99} | {fill:.1f} | {accept:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
