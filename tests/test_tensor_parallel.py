"""Tensor parallelism on the CPU (gloo): 2 ranks give the tokens of 1 rank, through `LLM`
and through `slipstream serve`; KV heads replicated when fewer than ranks; head counts
that do not split fail at once; a rank killed mid-run ends the engine within seconds
and leaves no process behind."""
from __future__ import annotations

import os
import signal
import time

import pytest

from slipstream import LLM, SamplingParams
from slipstream.errors import EngineDeadError
from slipstream.frontend.outputs import OutputKind
from slipstream.model.config import ModelConfig
from slipstream.model.parallel import TPShard, check_tensor_parallel

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], list(range(20, 60)), [3] * 17]


def _params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
            SamplingParams(max_tokens=6, temperature=1.0, top_k=20, seed=5, logprobs=2, ignore_eos=True),
            SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1, ignore_eos=True)]


def _run(folder: str, tp: int):
    with LLM(folder, device="cpu", dtype="float32", max_model_len=128, tensor_parallel_size=tp) as llm:
        outs = llm.generate(PROMPTS, _params())
        return outs, (llm.engine.runner.procs if tp > 1 else [])


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie is gone too
    except OSError:
        return True


# llama: KV heads split (4 q, 2 kv heads), untied, weights in safetensors shards;
# qwen3: q/k norms, head_dim != hidden / heads; llama3: 1 KV head replicated on both
# ranks, tied embeddings (the vocab-parallel embedding is the LM head)
@pytest.mark.subprocess
@pytest.mark.parametrize("kind", ["llama", "qwen3", "llama3"])
def test_two_ranks_give_the_tokens_of_one(tiny_model, kind):
    folder, _ = tiny_model(kind)
    one, _ = _run(folder, 1)
    two, procs = _run(folder, 2)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    for a, b in zip(one[2].logprobs, two[2].logprobs):  # logprobs come back from rank 0
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert len(two[3].prompt_logprobs) == len(one[3].prompt_logprobs) == len(PROMPTS[3])
    assert procs and all(_gone(p.pid) for p in procs)  # shutdown stopped the ranks


def test_shards_split_or_replicate_kv_heads():
    cfg = ModelConfig("LlamaForCausalLM", 100, 64, 96, 1, num_heads=8, num_kv_heads=2, head_dim=8)
    assert [TPShard(r, 4, cfg).kv_head_start for r in range(4)] == [0, 0, 1, 1]  # replicated
    assert [TPShard(r, 2, cfg).kv_head_start for r in range(2)] == [0, 1]  # split
    assert TPShard(3, 4, cfg).num_kv_heads == 1 and TPShard(0, 2, cfg).num_kv_heads == 1
    assert [TPShard(r, 8, cfg).vocab_rows() for r in range(8)] == [13] * 7 + [9]  # 100 = 7 x 13 + 9


def test_head_counts_that_do_not_split(tiny_model, capsys):
    cfg = ModelConfig("LlamaForCausalLM", 100, 96, 96, 1, num_heads=12, num_kv_heads=6, head_dim=8)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 and the model's num_key_value_heads=6"):
        check_tensor_parallel(cfg, 4)
    folder, _ = tiny_model("llama")  # 4 query heads
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=3 does not divide the model's "
                                         r"num_attention_heads=4$"):
        LLM(folder, device="cpu", tensor_parallel_size=3)
    from slipstream import AsyncLLM
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        AsyncLLM(folder, device="cpu", tensor_parallel_size=3)  # before the core process starts
    from slipstream.cli.main import main
    assert main(["generate", "hi", "--model", folder, "--device", "cpu", "-tp", "3"]) == 2
    assert "error: tensor_parallel_size=3 does not divide" in capsys.readouterr().err
    assert time.monotonic() - start < 10


@pytest.mark.subprocess
def test_a_killed_rank_ends_the_engine_within_seconds(tiny_model):
    folder, _ = tiny_model("llama")
    llm = LLM(folder, device="cpu", max_model_len=512, tensor_parallel_size=2)
    procs = llm.engine.runner.procs
    for p in PROMPTS:
        llm.add_request(p, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True),
                        output_kind=OutputKind.DELTA)
    outputs = llm.outputs()
    next(outputs)  # running
    os.kill(procs[1].pid, signal.SIGKILL)
    killed = time.monotonic()
    ended = [o for o in outputs if o.finished]
    took = time.monotonic() - killed
    assert took < 5, took
    assert len(ended) == len(PROMPTS) and all(o.finish_reason == "error" for o in ended)
    assert "tensor-parallel rank 1 died (killed by SIGKILL)" in ended[0].error
    with pytest.raises(EngineDeadError, match="rank 1 died"):
        llm.generate([[1, 2, 3]])
    deadline = time.monotonic() + 5
    while not all(_gone(p.pid) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p.pid) for p in procs)  # rank 0 was stopped too
    llm.shutdown()


@pytest.mark.subprocess
def test_a_hung_rank_ends_the_engine_at_the_collective_timeout(tiny_model, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_TP_TIMEOUT_S", "3")  # (read by the workers as they start)
    folder, _ = tiny_model("llama")
    llm = LLM(folder, device="cpu", max_model_len=512, tensor_parallel_size=2)
    procs = llm.engine.runner.procs
    llm.add_request(PROMPTS[0], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True),
                    output_kind=OutputKind.DELTA)
    outputs = llm.outputs()
    next(outputs)
    os.kill(procs[1].pid, signal.SIGSTOP)
    stopped = time.monotonic()
    ended = [o for o in outputs if o.finished]
    assert time.monotonic() - stopped < 3 + 5
    assert ended[0].finish_reason == "error" and "another rank hangs" in ended[0].error
    deadline = time.monotonic() + 5  # the stopped rank is killed (SIGTERM waits while it is stopped)
    while not all(_gone(p.pid) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p.pid) for p in procs)
    llm.shutdown()


@pytest.mark.subprocess
def test_serve_with_two_ranks(tokenized_tiny):
    import openai

    from server_utils import ServerProcess, child_pids
    common = ("--model", tokenized_tiny, "--max-model-len", "256", "--served-model-name", "tiny")
    asks = [dict(prompt="The capital of", max_tokens=8, temperature=0),
            dict(prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=7)]
    with LLM(tokenized_tiny, device="cpu", max_model_len=256) as one:
        want = [one.generate(a["prompt"], SamplingParams(max_tokens=a["max_tokens"], temperature=a["temperature"],
                                                          seed=a.get("seed"), ignore_eos=True))[0].text
                for a in asks]
    server = ServerProcess(*common, "--tensor-parallel-size", "2")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        got = [client.completions.create(model="tiny", extra_body={"ignore_eos": True}, **a).choices[0].text
               for a in asks]
        assert got == want
        core = child_pids(server.proc.pid)
        ranks = [pid for c in core for pid in child_pids(c)]
        assert len(ranks) >= 2
    finally:
        code = server.terminate()
        server.kill()
    assert code == 0
    assert all(_gone(pid) for pid in ranks)


@pytest.mark.subprocess
def test_two_ranks_on_the_async_mix(tokenized_tiny):
    """The sync-vs-async mix (stops, seeds, penalties, aborts, preemptions, chunked prefill)
    on 2 ranks with the pipeline running ahead gives the one-rank sync results."""
    from async_mix import mix, run_mix
    reqs = mix(tokenized_tiny, n=16)  # (16 of its 28 kinds of request: CI time)
    common = dict(device="cpu", max_model_len=256, num_kv_blocks=24, max_num_batched_tokens=64, max_num_seqs=12)
    with LLM(tokenized_tiny, async_scheduling=False, **common) as one:
        want = run_mix(one, reqs)
    with LLM(tokenized_tiny, async_scheduling=True, tensor_parallel_size=2, **common) as two:
        assert run_mix(two, reqs) == want
        assert two.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("kind", ["llama", "llama3"])
def test_each_rank_loads_its_shard(tiny_model, tmp_path, kind):
    """safetensors slices, GGUF tensors (F32 narrowed; Q8_0 and Q4_1 dequantized for the
    rank's rows or blocks of columns only), dummy weights drawn whole and narrowed: each
    rank's parameters are its slice of the one-rank model's (no process group needed)."""
    import torch

    from helpers import write_gguf
    from slipstream.model.loader import load_model
    from slipstream.model.parallel import TPGroup
    folder, hf = tiny_model(kind)
    ggufs = []
    for qtype in (None, "Q8_0", "Q4_1"):
        ggufs.append((str(tmp_path / f"m-{qtype}.gguf"), "gguf"))
        write_gguf(hf, ggufs[-1][0], qtype)
    for source, fmt in ((folder, "auto"), *ggufs, (folder, "dummy")):
        whole, cfg = load_model(source, fmt)
        d, a = cfg.head_dim, whole.layers[0].self_attn
        for rank in range(2):
            s = TPShard(rank, 2, cfg)
            part, _ = load_model(source, fmt, tp=TPGroup(s, None))
            for w, p in zip(whole.layers, part.layers):
                qkv = w.self_attn.qkv_proj.weight
                q, k, v = qkv[:a.q_size], qkv[a.q_size:a.q_size + a.kv_size], qkv[a.q_size + a.kv_size:]
                kv = slice(s.kv_head_start * d, (s.kv_head_start + s.num_kv_heads) * d)
                heads = slice(rank * s.num_heads * d, (rank + 1) * s.num_heads * d)
                assert torch.equal(p.self_attn.qkv_proj.weight, torch.cat([q[heads], k[kv], v[kv]]))
                assert torch.equal(p.self_attn.o_proj.weight, w.self_attn.o_proj.weight[:, heads])
                i = s.intermediate_size
                cols = slice(rank * i, (rank + 1) * i)
                gate, up = w.mlp.gate_up_proj.weight.chunk(2)
                assert torch.equal(p.mlp.gate_up_proj.weight, torch.cat([gate[cols], up[cols]]))
                assert torch.equal(p.mlp.down_proj.weight, w.mlp.down_proj.weight[:, cols])
            rows = slice(s.vocab_start, s.vocab_start + s.vocab_rows())
            assert torch.equal(part.embed_tokens.weight, whole.embed_tokens.weight[rows])
            assert torch.equal(part.lm_head_weight, whole.lm_head_weight[rows])
