"""The engine core's new paths on a CUDA GPU (marked `gpu`): prompt logprobs on the eager
path beside CUDA-graph steps, and AsyncLLM with the core in its own process."""
import asyncio

import pytest

from slipstream import LLM, AsyncLLM, SamplingParams

pytestmark = pytest.mark.gpu

OPTS = dict(dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)


def test_prompt_logprobs_on_the_gpu_equal_the_cpu_engine(tiny_model):
    folder, _ = tiny_model("llama")
    prompts = [[(7 * i) % 200 + 3 for i in range(150)], [5, 6, 7, 8]]  # 150 tokens: 3 chunks of 64
    sp = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2)
    cpu = LLM(folder, device="cpu", **OPTS).generate(prompts, sp)
    gpu = LLM(folder, device="cuda", **OPTS).generate(prompts, sp)
    for c, g in zip(cpu, gpu):
        assert c.token_ids == g.token_ids
        assert len(c.prompt_logprobs) == len(g.prompt_logprobs) == len(c.prompt_token_ids)
        for ce, ge in zip(c.prompt_logprobs[1:], g.prompt_logprobs[1:]):
            assert ce.keys() == ge.keys()
            assert all(abs(ce[t] - ge[t]) < 1e-3 for t in ce)


def test_async_llm_process_core_on_the_gpu_equals_llm(tiny_model):
    folder, _ = tiny_model("llama")
    prompts = [[(11 * i + j) % 200 + 3 for j in range(5 + 3 * i)] for i in range(10)]
    params = [SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.9, seed=i) for i in range(10)]
    ref = LLM(folder, device="cuda", **OPTS).generate(prompts, params)

    async def main():
        async with AsyncLLM(folder, core="process", device="cuda", **OPTS) as llm:
            async def one(p, sp):
                async for out in llm.generate(p, sp):
                    pass
                return out
            return await asyncio.gather(*[one(p, sp) for p, sp in zip(prompts, params)])

    got = asyncio.run(main())
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
