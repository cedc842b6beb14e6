"""A mixed workload for the sync-vs-async equivalence tests (CPU and GPU).

A tiny random Llama with the SmolLM2 tokenizer (so stop strings and text are real),
whose EOS is a token it emits now and then; 28 requests with different prompt lengths,
max_tokens, stop strings, seeds, temperatures, shared prefixes, staggered arrivals and
aborts.  `run_mix` drives the engine step by step and returns what every request saw.
"""
from __future__ import annotations

import collections
import json
import os
import random

import torch

from slipstream import LLM, OutputKind, SamplingParams


def make_tokenized_tiny_llama(folder: str) -> None:
    import transformers

    from slipstream.model.tokenizer import load_tokenizer

    # the embedded SmolLM2's tokenizer, without loading its weights; or the same tokenizer
    # saved as a folder (SLIPSTREAM_TEST_TOKENIZER: the GPU machine, where the GGUF is not carried)
    tok = load_tokenizer(os.environ.get("SLIPSTREAM_TEST_TOKENIZER"))
    config = transformers.LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float()
    with torch.no_grad():  # 60 tokens with long embeddings: outputs draw mostly from them
        model.model.embed_tokens.weight[300:360] *= 6.0
    model.save_pretrained(folder)
    tok.hf.save_pretrained(folder)
    # Pilot run on the mix's own prompts: EOS becomes the token this model emits most
    # (past its first two tokens), the stop strings two characters its texts often hold.
    probe = LLM(folder, device="cpu", max_model_len=256)
    prompts = [r["prompt"] for r in _requests(stops=["", ""])]
    outs = probe.generate(prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    counts = collections.Counter(t for o in outs for t in o.token_ids[2:])
    texts = [probe.tokenizer.decode(o.token_ids) for o in outs]
    chars = collections.Counter(c for t in texts for c in set(t) if c.isalpha())
    stops = [chars.most_common(12)[-1][0], chars.most_common(20)[-1][0]]
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["eos_token_id"] = counts.most_common(1)[0][0]
    with open(path, "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(folder, "stop_strings.json"), "w") as f:
        json.dump(stops, f)


def mix(folder: str, sampled: bool = True, n: int = 28) -> list[dict]:
    with open(os.path.join(folder, "stop_strings.json")) as f:
        return _requests(json.load(f), sampled, n)


def _requests(stops: list[str], sampled: bool = True, n: int = 28) -> list[dict]:
    rng = random.Random(1)
    shared = [rng.randrange(3, 40000) for _ in range(40)]
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(3, 40000) for _ in range(rng.randint(1, 90))]
        if i % 3 == 0:
            prompt = shared + prompt
        temperature = 0.0 if (i % 2 == 0 or not sampled) else rng.choice([0.7, 1.0])
        params = SamplingParams(
            max_tokens=rng.randint(1, 40), temperature=temperature, seed=i, top_k=rng.choice([0, 40]),
            top_p=rng.choice([1.0, 0.9]), stop=(stops[i % 2],) if i % 4 == 1 and stops[0] else None,
            ignore_eos=(i % 5 == 0), min_tokens=2 if i % 7 == 3 else 0)
        reqs.append(dict(id=f"r{i}", prompt=prompt, params=params, arrival=rng.choice([0, 0, 1, 3, 6, 10]),
                         abort_after=rng.choice([2, 5]) if i % 9 == 4 else None))
    return reqs


def run_mix(llm: LLM, reqs: list[dict]) -> dict[str, tuple]:
    todo = sorted(reqs, key=lambda r: r["arrival"])
    aborts = {r["id"]: r["abort_after"] for r in reqs if r["abort_after"]}
    results, seen, step = {}, {}, 0
    while todo or llm.has_unfinished_requests():
        while todo and todo[0]["arrival"] <= step:
            r = todo.pop(0)
            llm.add_request(r["prompt"], r["params"], request_id=r["id"], output_kind=OutputKind.DELTA)
        for out in llm.step():
            seen[out.request_id] = seen.get(out.request_id, 0) + len(out.new_token_ids)
            if out.finished:
                results[out.request_id] = (out.token_ids, out.text, out.finish_reason)
        for rid, k in aborts.items():
            if rid not in results and seen.get(rid, 0) >= k:
                llm.abort_request(rid)
                seen[rid] = -1 << 30  # once
        step += 1
    return results
