"""The grammar's CPU cost per step when the model draws uniformly among the allowed tokens,
as the constrained bench workloads do under dummy weights: `--rows` matchers of the bench
schema (BENCH_SCHEMA) fill their bitmask rows, each row draws a random allowed token, and
every matcher accepts its token.  Times the fill (xgrammar's batch matcher over `--threads`)
and the accepts (one call a row; and split over a thread pool, which scales only where the
library lets go of the GIL).

    python benchmarks/probe_grammar_random.py --tokenizer .smoltok [--rows 256] [--steps 60]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from slipstream.bench.run import bench_grammar_tokenizer
from slipstream.bench.workloads import BENCH_SCHEMA
from slipstream.sampling.grammar.bitmask import allocate_bitmask
from slipstream.sampling.grammar.compiler import GrammarCompiler
from slipstream.sampling.grammar.matcher import fill_bitmasks
from slipstream.sampling.grammar.xgrammar_backend import XGrammarBackend
from slipstream.sampling.structured import StructuredOutputsParams

VOCAB = 151936  # small-256's model


def random_allowed(bitmask: torch.Tensor, gen: torch.Generator) -> list[int]:
    bits = ((bitmask[:, :, None] >> torch.arange(32)) & 1).reshape(bitmask.shape[0], -1)[:, :VOCAB]
    return torch.multinomial(bits.float() + 1e-12, 1, generator=gen)[:, 0].tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    a = ap.parse_args()
    tok = bench_grammar_tokenizer(a.tokenizer)
    out: dict = {"rows": a.rows, "steps": a.steps}
    tokens: list[list[int]] = []
    for nt in a.threads:
        backend = XGrammarBackend(tok, vocab_size=VOCAB, stop_token_ids=[0], batch_threads=nt)
        comp = GrammarCompiler(backend)
        grammar = comp.submit(StructuredOutputsParams(json=BENCH_SCHEMA))
        while not grammar.ready():
            time.sleep(0.01)
        matchers = [comp.new_matcher(grammar) for _ in range(a.rows)]
        bitmask = allocate_bitmask(a.rows, VOCAB)
        gen = torch.Generator().manual_seed(0)
        pool = ThreadPoolExecutor(nt)
        edges = np.linspace(0, a.rows, nt + 1).astype(int)
        fill, accept = [], []
        for step in range(a.steps):
            t0 = time.perf_counter()
            fill_bitmasks(matchers, bitmask, list(range(a.rows)))
            fill.append(time.perf_counter() - t0)
            if len(tokens) <= step:
                tokens.append(random_allowed(bitmask, gen))
            toks = tokens[step]

            def work(c: int, toks=toks) -> None:
                for i in range(edges[c], edges[c + 1]):
                    matchers[i].accept(toks[i])
            t1 = time.perf_counter()
            list(pool.map(work, range(nt)))
            accept.append(time.perf_counter() - t1)
        out[f"threads_{nt}"] = {"fill_ms_median": 1e3 * statistics.median(fill),
                                "accept_ms_median": 1e3 * statistics.median(accept)}
        comp.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
