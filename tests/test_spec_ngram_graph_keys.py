"""Which route and graph key each step of an n-gram engine takes at batch 1, on the CPU.

A GPU replays a padded verify step (runner/verify_graphs.py) from a graph keyed by (slot,
rows, k + 1, sampler variant, decode split count, synthetic acceptance); a step off the
padded route runs the whole forward eagerly, a few milliseconds of host time on a small
model.  Here the CPU runner gets the GPU's padding (StepGraphs with no pool: plain steps run
eagerly, as their graphs would), stand-in verify graphs with the same keying (a capture
records the step's closure, a replay runs it again with the buffers' current contents, as a
CUDA graph does) and a real decode split policy (a small GPU's SM count, short chunks, so
split counts vary with the context).  Asserted under asynchronous scheduling: every step
after the prefill is a plain decode step or a padded verify step, including the steps that
only shift a row after a verification (no draft slots of their own), the keys stay within
one per (slot, split option), every use after a key's first replays, and the greedy tokens
equal plain decoding's (a replay holds no value of its capture's step)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import StandInSteps

from slipstream import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# repeats that the drafts copy, then tokens the model continues on its own: steps with and
# without draft slots, and the steps that only shift a row after a verification
PROMPT = [5, 6, 7, 8, 9, 10] * 3 + [200, 17, 90, 33]


def _graphed(llm, num_sms: int = 2):
    from slipstream.ops.attention_tuning import DEFAULT_DECODE_CONFIG, DecodeSplitPolicy
    from slipstream.ops.triton_attention import effective_decode_config
    from slipstream.runner.graphs import StepGraphs, capture_sizes
    from slipstream.runner.verify_graphs import VerifyGraphs

    runner = llm.engine.runner
    c = runner.model_config
    cfg = replace(effective_decode_config(DEFAULT_DECODE_CONFIG, torch.bfloat16, c.head_dim, 1),
                  block_n=16, min_chunk=16)
    runner.split_policy = DecodeSplitPolicy(runner.num_kv_heads, runner.max_model_len, cfg, num_sms)
    runner.graphs = StepGraphs(capture_sizes(8), [], 8, runner.max_model_len)
    runner.verify_graphs = VerifyGraphs(StandInSteps())
    return runner.verify_graphs


@pytest.fixture
def launches(monkeypatch):
    """Each launch of the engine: 'plain', 'padded' (a verify step on the padded route) or
    'eager' (a speculative step off it), and whether it had draft slots."""
    from slipstream.runner import model_runner, speculative

    seen = []
    launch, padded = model_runner.ModelRunner.launch, speculative._launch_padded

    def spy_launch(self, batch):
        seen.append(["plain" if batch.spec is None else "eager",
                     batch.spec is not None and bool(np.any(batch.spec.num_drafts))])
        return launch(self, batch)

    def spy_padded(*a, **kw):
        seen[-1][0] = "padded"
        return padded(*a, **kw)

    monkeypatch.setattr(model_runner.ModelRunner, "launch", spy_launch)
    monkeypatch.setattr(speculative, "_launch_padded", spy_padded)
    return seen


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_every_speculative_step_at_batch_one_replays_a_padded_graph(tiny_model, launches):
    folder, _ = tiny_model("llama")
    new = 120
    max_len = len(PROMPT) + new
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    plain = _tokens(LLM(folder, device="cpu", max_num_seqs=8, max_model_len=max_len).generate([PROMPT], params))
    llm = LLM(folder, device="cpu", max_num_seqs=8, max_model_len=max_len, speculative_config=NGRAM,
              async_scheduling=True)
    g = _graphed(llm)
    launches.clear()
    assert _tokens(llm.generate([PROMPT], params)) == plain
    kinds = [k for k, _ in launches[1:]]
    verify = [k for k, slots in launches[1:] if k != "plain"]
    shift_only = [k for k, slots in launches[1:] if k != "plain" and not slots]
    assert launches[0][0] == "plain" and len(verify) >= 10 and shift_only, launches
    assert "eager" not in kinds, launches  # every speculative step on the padded route
    policy = llm.engine.runner.split_policy
    keys = sorted(g.graphs)
    assert {k[0] for k in keys} == {0, 1} and {k[1:4] for k in keys} == {(1, 4, False)}, keys
    assert {k[4] for k in keys} <= set(policy.options(1)), keys
    assert g.steps.captures == len(keys) <= 2 * len(policy.options(1)), keys
    # a key's first use runs eagerly (it compiles the kernels); every other use replays
    assert sum(g.replays) == len(verify) - len(g.seen), (g.replays, len(verify), g.seen)
    assert llm.engine.stats()["spec_num_accepted_tokens"] > 0


@pytest.mark.gpu
def test_gpu_smollm2_batch_one_speculative_steps_replay_and_launch_like_plain_ones(launches, monkeypatch):
    """SmolLM2 in bf16 on a GPU, batch 1, async n-gram (k = 4) on a copying prompt, warmed up
    once: every speculative step takes the padded route and replays its graph, and the host's
    launch of a speculative step takes at most 1 ms more than a plain engine's decode step's
    (medians; the torch drafting ops and the eager steps that only shift took 3-5 ms)."""
    import time

    from slipstream.runner import model_runner

    took = []
    launch = model_runner.ModelRunner.launch

    def timed(self, batch):
        t = time.perf_counter()
        out = launch(self, batch)
        took.append((batch.spec is not None, time.perf_counter() - t))
        return out

    monkeypatch.setattr(model_runner.ModelRunner, "launch", timed)
    prompt = ("Copy the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape.\n"
              "Copy: apple, banana, cherry, date, elderberry, fig, grape.\nList: red, green, blue, "
              "yellow, purple, orange, black, white.\nCopy:")
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    params = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    common = dict(device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=4, async_scheduling=True)
    plain = LLM(**common)
    plain.generate([prompt], params)
    took.clear()
    plain.generate([prompt], params)
    plain_s = sorted(t for _, t in took[1:])
    del plain
    import gc
    gc.collect()  # (its KV cache: the next engine sizes its own from the memory left)
    torch.cuda.empty_cache()
    llm = LLM(speculative_config=spec, **common)
    llm.generate([prompt], params)  # (warm-up: the graphs of these keys)
    launches.clear(), took.clear()
    vg = llm.engine.runner.verify_graphs
    replays = sum(vg.replays)
    # (bf16's verify and decode kernels round differently: token equality is test_gpu_spec.py's, batch-invariant)
    assert len(llm.generate([prompt], params)[0].outputs[0].token_ids) == 96
    verify = [k for k, _ in launches[1:] if k != "plain"]
    assert verify and "eager" not in [k for k, _ in launches[1:]], launches
    assert sum(vg.replays) - replays == len(verify), (vg.replays, replays, len(verify))
    spec_s = sorted(t for s, t in took[1:] if s)
    assert len(spec_s) >= 10 and len(plain_s) >= 50
    median = spec_s[len(spec_s) // 2] - plain_s[len(plain_s) // 2]
    assert median < 1e-3, (spec_s, plain_s)
