"""Prompt sets for `slipstream bench serve`: random token ids, small-256, or a JSONL file.

Each set is a list of `ServeRequest`: the prompt (text or token ids), its length in
tokens when known, the number of tokens to ask for, and, for named workloads, the
sampling settings that belong to the workload's definition (small-256: temperature
0.6, EOS ignored, request i seeded with i).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass


@dataclass
class ServeRequest:
    prompt: str | list[int]
    prompt_len: int | None  # tokens, when known without a tokenizer (token-id prompts)
    output_len: int | None  # max_tokens to send; None leaves the server's default
    temperature: float | None = None  # the dataset's own, if its definition has one
    ignore_eos: bool = False


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float,
                    seed: int, vocab_size: int) -> list[ServeRequest]:
    """Token-id prompts with lengths drawn uniformly in [len·(1−r), len·(1+r)]."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)

    def bounds(n: int) -> tuple[int, int]:
        return max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))

    lo_in, hi_in = bounds(input_len)
    lo_out, hi_out = bounds(output_len)
    out = []
    for _ in range(num):
        n_in = rng.randint(lo_in, hi_in)
        prompt = [rng.randrange(vocab_size) for _ in range(n_in)]
        out.append(ServeRequest(prompt, n_in, rng.randint(lo_out, hi_out)))
    return out


def small_256_requests() -> list[ServeRequest]:
    """The small-256 workload, built by `slipstream.bench.workloads`."""
    from slipstream.bench.workloads import small_256

    w = small_256()
    return [ServeRequest(list(p), len(p), sp.max_tokens, sp.temperature, sp.ignore_eos)
            for p, sp in zip(w.prompts, w.params)]


def jsonl_requests(path: str) -> list[ServeRequest]:
    """One JSON object a line: `prompt` (str or list of token ids), optional
    `max_tokens` or `output_len`. Blank lines are skipped."""
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e})") from None
            if not isinstance(row, dict) or "prompt" not in row:
                raise ValueError(f"{path}:{lineno}: needs an object with a 'prompt'")
            prompt = row["prompt"]
            if isinstance(prompt, list):
                if not all(isinstance(t, int) for t in prompt):
                    raise ValueError(f"{path}:{lineno}: a list prompt must be token ids")
                n = len(prompt)
            elif isinstance(prompt, str):
                n = None
            else:
                raise ValueError(f"{path}:{lineno}: prompt must be a string or token ids")
            m = row.get("max_tokens", row.get("output_len"))
            out.append(ServeRequest(prompt, n, None if m is None else int(m)))
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def load_requests(args) -> list[ServeRequest]:
    """The prompt set the command line names, cut (or cycled) to --num-prompts."""
    if args.dataset == "random":
        n = args.num_prompts if args.num_prompts is not None else 1000
        return random_requests(n, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, args.seed, args.random_vocab_size)
    if args.dataset == "small-256":
        reqs = small_256_requests()
    else:
        reqs = jsonl_requests(args.dataset)
    n = args.num_prompts if args.num_prompts is not None else len(reqs)
    return [reqs[i % len(reqs)] for i in range(n)]
