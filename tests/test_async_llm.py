"""AsyncLLM on the engine core (thread and process): streaming, concurrency from tasks and
threads, aborts, failures that stay alone, a dead engine, n, prompt logprobs."""
import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from slipstream import LLM, AsyncLLM, EngineDeadError, SamplingParams

COMMON = dict(device="cpu", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)


def prompts(n):
    return [f"request {i}: tell me about the number {i * 7}" for i in range(n)]


def params(i):
    return SamplingParams(max_tokens=12 + i % 5, temperature=0.0 if i % 2 else 0.8, seed=100 + i)


async def stream(llm, prompt, sp, request_id=None, stop_after=None):
    """Consume one stream; check that the deltas add up to the whole, which only the last
    output carries."""
    text, ids, out = "", [], None
    async for out in llm.generate(prompt, sp, request_id=request_id):
        text += out.new_text
        ids += out.new_token_ids
        if out.finished:
            assert out.text == text and out.token_ids == ids
        else:
            assert out.text is None and out.token_ids is None
        if stop_after is not None and len(ids) >= stop_after:
            return None
    return out


@pytest.fixture(scope="module")
def reference(tokenized_tiny):
    llm = LLM(tokenized_tiny, **COMMON)
    outs = llm.generate(prompts(12), [params(i) for i in range(12)])
    return llm, [(o.text, o.token_ids, o.finish_reason) for o in outs]


@pytest.mark.slow
def test_streams_from_tasks_and_threads_equal_llm_generate(tokenized_tiny, reference):
    _, expected = reference

    async def main():
        async with AsyncLLM(tokenized_tiny, core="thread", **COMMON) as llm:
            assert llm.core_pid is None  # the core is a thread of this process
            loop = asyncio.get_running_loop()
            tasks = [asyncio.create_task(stream(llm, p, params(i))) for i, p in enumerate(prompts(12)) if i % 3]
            # the rest are submitted from other threads onto the loop
            futures = {}

            def submit(i):
                futures[i] = asyncio.run_coroutine_threadsafe(stream(llm, prompts(12)[i], params(i)), loop)

            threads = [threading.Thread(target=submit, args=(i,)) for i in range(0, 12, 3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            outs = await asyncio.gather(*tasks)
            thread_outs = [await asyncio.wrap_future(futures[i]) for i in range(0, 12, 3)]
            stats = await llm.stats()
        return outs, thread_outs, stats

    outs, thread_outs, stats = asyncio.run(main())
    got = {}
    for i, o in zip([i for i in range(12) if i % 3], outs):
        got[i] = (o.text, o.token_ids, o.finish_reason)
    for i, o in zip(range(0, 12, 3), thread_outs):
        got[i] = (o.text, o.token_ids, o.finish_reason)
    assert [got[i] for i in range(12)] == expected
    assert stats["num_running"] == stats["num_waiting"] == stats["kv_blocks_in_use"] == 0
    assert stats["kv_blocks_total"] > 0 and 0.0 <= stats["prefix_cache_hit_rate"] <= 1.0


def test_abort_and_leaving_early_free_blocks_and_leave_the_others_unchanged(tokenized_tiny, reference):
    _, expected = reference

    async def main():
        async with AsyncLLM(tokenized_tiny, core="thread", **COMMON) as llm:
            sp = SamplingParams(max_tokens=200, temperature=0.8, seed=1, ignore_eos=True)
            leaver = asyncio.create_task(stream(llm, "a long one", sp, stop_after=3))
            aborted = asyncio.create_task(stream(llm, "another long one", sp, request_id="victim"))
            cancelled = asyncio.create_task(stream(llm, "a third long one", sp))
            good = [asyncio.create_task(stream(llm, p, params(i))) for i, p in enumerate(prompts(6))]
            while (await llm.stats())["num_running"] < 3:
                await asyncio.sleep(0.01)
            await llm.abort("victim")
            cancelled.cancel()
            assert await leaver is None
            victim = await aborted
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            outs = await asyncio.gather(*good)
            deadline = time.monotonic() + 10
            while (stats := await llm.stats())["kv_blocks_in_use"] and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        return victim, outs, stats

    victim, outs, stats = asyncio.run(main())
    assert victim.finish_reason == "abort" and victim.finished and len(victim.token_ids) < 200
    assert [(o.text, o.token_ids, o.finish_reason) for o in outs] == expected[:6]
    assert stats["kv_blocks_in_use"] == 0 and stats["num_running"] == 0


def test_bad_requests_fail_alone(tokenized_tiny, reference):
    _, expected = reference

    async def main():
        async with AsyncLLM(tokenized_tiny, core="thread", **COMMON) as llm:
            bad = [stream(llm, [5] * 250, SamplingParams(max_tokens=20)),  # too long
                   stream(llm, [3, 10 ** 9], SamplingParams()),  # outside the vocabulary
                   stream(llm, [1.5, 2.5], SamplingParams()),  # not token ids
                   stream(llm, "", SamplingParams())]  # empty? (BOS-less tokenizer: 0 tokens)
            good = [stream(llm, p, params(i)) for i, p in enumerate(prompts(4))]
            return await asyncio.gather(*bad, *good)

    *bad, g0, g1, g2, g3 = asyncio.run(main())
    for out, words in zip(bad, ["max_model_len=256", "outside the vocabulary", "token ids", "empty"]):
        assert out.finished and out.finish_reason == "error" and words in out.error, out.error
    assert [(o.text, o.token_ids, o.finish_reason) for o in (g0, g1, g2, g3)] == expected[:4]
    with pytest.raises(ValueError, match="max_model_len"):
        AsyncLLM.validate(type("L", (), {"tokenizer": None, "info": reference[0].info})(), [5] * 300)


@pytest.mark.slow
def test_a_long_text_prompt_is_tokenized_off_the_event_loop(tokenized_tiny, reference):
    """A text longer than `tokenize_off_loop_chars` is tokenized on a worker thread while the
    loop goes on (a ticker keeps ticking through a 0.4 s tokenization); a short one stays on
    the loop; the outputs are the offline engine's; two such requests racing for one id:
    one runs, the other is refused."""
    _, expected = reference

    async def main():
        async with AsyncLLM(tokenized_tiny, core="thread", **COMMON) as llm:
            encode, threads = llm.tokenizer.encode, []

            def slow_encode(text):
                threads.append(threading.get_ident())
                time.sleep(0.4)
                return encode(text)
            llm.tokenizer.encode = slow_encode
            ticks = []

            async def ticker():
                while True:
                    ticks.append(time.perf_counter())
                    await asyncio.sleep(0.01)
            tick_task = asyncio.create_task(ticker())
            short = await stream(llm, prompts(2)[1], params(1))  # shorter than 1,024 characters
            llm.tokenize_off_loop_chars = 8
            start = time.perf_counter()
            long = await stream(llm, prompts(3)[2], params(2))
            ticks_meanwhile = sum(t > start for t in ticks)
            racing = await asyncio.gather(*(stream(llm, prompts(4)[3], params(3), request_id="same")
                                            for _ in range(2)), return_exceptions=True)
            tick_task.cancel()
            return short, long, ticks_meanwhile, threads, racing

    short, long, ticks_meanwhile, threads, racing = asyncio.run(main())
    loop_thread = threading.get_ident()  # (asyncio.run's loop ran on this thread)
    assert threads[0] == loop_thread and all(t != loop_thread for t in threads[1:]) and len(threads) == 4
    assert ticks_meanwhile >= 20, ticks_meanwhile  # the loop ran on through the 0.4 s
    assert (short.text, short.token_ids, short.finish_reason) == expected[1]
    assert (long.text, long.token_ids, long.finish_reason) == expected[2]
    errors = [r for r in racing if isinstance(r, ValueError)]
    outs = [r for r in racing if not isinstance(r, BaseException)]
    assert len(errors) == 1 and "already in use" in str(errors[0])
    assert len(outs) == 1 and (outs[0].text, outs[0].token_ids, outs[0].finish_reason) == expected[3]


@pytest.fixture
def fail_launches_after(monkeypatch):
    """`fail_launches_after(n)`: every model runner's launches after the first `n` raise, as
    a CUDA error in a step would (patched on the class: it reaches a core thread's runner)."""
    from slipstream.runner.model_runner import ModelRunner

    def arm(n: int) -> None:
        launch, calls = ModelRunner.launch, []

        def failing_launch(runner, batch):
            calls.append(1)
            if len(calls) > n:
                raise RuntimeError("injected CUDA error")
            return launch(runner, batch)

        monkeypatch.setattr(ModelRunner, "launch", failing_launch)

    return arm


def test_an_exception_in_a_step_ends_every_stream_and_the_engine(tokenized_tiny, fail_launches_after):
    async def main():
        async with AsyncLLM(tokenized_tiny, core="thread", **COMMON) as llm:
            fail_launches_after(3)
            sp = SamplingParams(max_tokens=100, ignore_eos=True)
            tasks = [asyncio.create_task(stream(llm, p, sp)) for p in prompts(5)]
            t0 = time.monotonic()
            outs = await asyncio.wait_for(asyncio.gather(*tasks), 10)
            elapsed = time.monotonic() - t0
            assert llm.is_dead  # the death comes with the error outputs, not after them
            with pytest.raises(EngineDeadError, match="injected CUDA error"):
                async for _ in llm.generate("more", sp):
                    pass
            with pytest.raises(EngineDeadError):
                await llm.stats()
            assert llm.is_dead
        return outs, elapsed

    outs, elapsed = asyncio.run(main())
    assert all(o.finish_reason == "error" and "injected CUDA error" in o.error for o in outs)
    assert elapsed < 1.0 + 0.5  # (the steps before the failure included)


def test_a_dying_core_sends_its_error_outputs_and_its_death_in_one_message(tokenized_tiny, fail_launches_after):
    """Two messages would let a request arrive between them, be taken by the front end and
    then end with an error output instead of EngineDeadError."""
    from slipstream.config import EngineConfig
    from slipstream.core.client import CoreClient
    from slipstream.core.messages import AddRequest, CoreDead, StepOutputs
    client = CoreClient(EngineConfig.from_kwargs(model=tokenized_tiny, **COMMON), "thread")
    try:
        client.wait_ready(60)
        fail_launches_after(2)
        params = SamplingParams(max_tokens=40, ignore_eos=True).to_dict()
        client.send_many([AddRequest(f"r{i}", [1, 2, 3, 4 + i], params) for i in range(2)])
        deadline, msgs = time.monotonic() + 30, []
        while time.monotonic() < deadline and not (msgs and isinstance(msgs[-1], CoreDead)):
            msg = client.recv(200)
            if msg is not None:
                msgs.append(msg)
        dead = msgs[-1]
        assert isinstance(dead, CoreDead) and "injected CUDA error" in dead.message
        assert sorted(o.request_id for o in dead.outputs) == ["r0", "r1"]
        assert all(o.finish_reason == "error" and "injected CUDA error" in o.error for o in dead.outputs)
        steps = [o for m in msgs[:-1] for o in m.outputs]
        assert all(isinstance(m, StepOutputs) for m in msgs[:-1]) and not any(o.error for o in steps)
    finally:
        client.close()


def test_a_core_thread_that_dies_ends_the_offline_batch_with_errors(tokenized_tiny, fail_launches_after):
    llm = LLM(tokenized_tiny, core="thread", **COMMON)
    try:
        fail_launches_after(3)
        outs = llm.generate(prompts(4), SamplingParams(max_tokens=50, ignore_eos=True))
        assert [o.outputs[0].finish_reason for o in outs] == ["error"] * 4
        assert all("injected CUDA error" in o.error for o in outs)
        with pytest.raises(EngineDeadError, match="injected CUDA error"):
            llm.generate("more", SamplingParams(max_tokens=5))
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_n_completions_share_the_prompt_and_have_their_own_seeds(tokenized_tiny):
    llm = LLM(tokenized_tiny, **COMMON)
    prompt = "a shared prompt that is long enough to fill a few blocks of sixteen tokens " * 2
    one = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=7))[0]
    hits = llm.engine.pool.num_hits
    many = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=4))[0]
    assert [c.index for c in many.outputs] == [0, 1, 2, 3] and many.finished
    assert many.outputs[0].token_ids == one.token_ids  # completion 0 keeps the seed
    assert len({tuple(c.token_ids) for c in many.outputs}) > 1  # the others draw their own
    assert llm.engine.pool.num_hits - hits >= 3 * (len(many.prompt_token_ids) // 16)  # prompt once
    again = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=4))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in many.outputs]


def test_prompt_logprobs_equal_a_direct_computation_with_chunked_prefill(tokenized_tiny):
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(tokenized_tiny, dtype=torch.float32)
    llm = LLM(tokenized_tiny, **dict(COMMON, max_num_batched_tokens=16, max_num_seqs=2))
    prompt = "The prompt logprobs of a prompt longer than one chunk of sixteen tokens, " * 3
    warm = llm.generate(prompt, SamplingParams(max_tokens=1))[0]  # its blocks are now cached
    out = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))[0]
    ids = out.prompt_token_ids
    assert ids == warm.prompt_token_ids and len(ids) > 40
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        entry = plp[i]
        assert abs(entry[ids[i]] - ref[i - 1, ids[i]].item()) < 1e-3
        top = ref[i - 1].topk(3)
        for t, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[t] - lp) < 1e-3
    assert len(out.token_ids) == 1


def test_a_bad_prompt_in_a_list_queues_nothing(tokenized_tiny, reference):
    llm, expected = reference
    with pytest.raises(TypeError, match="prompt"):
        llm.generate([prompts(1)[0], [1.5]], params(0))
    assert not llm.has_unfinished_requests()
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams(temprature=0.5)
    outs = llm.generate(prompts(2), [params(0), params(1)])
    assert [(o.text, o.token_ids, o.finish_reason) for o in outs] == expected[:2]


# -- the core in its own process ------------------------------------------------------------
@pytest.mark.subprocess
def test_process_core_gives_the_same_outputs_and_a_killed_core_is_reported(tokenized_tiny, reference):
    _, expected = reference

    async def main():
        llm = AsyncLLM(tokenized_tiny, core="process", **COMMON)
        try:
            outs = await asyncio.gather(*[stream(llm, p, params(i)) for i, p in enumerate(prompts(12))])
            long = asyncio.create_task(stream(llm, "long", SamplingParams(max_tokens=250, ignore_eos=True)))
            await asyncio.sleep(0.3)
            assert llm.core_pid != os.getpid()
            os.kill(llm.core_pid, signal.SIGKILL)
            dead = await asyncio.wait_for(long, 10)
            assert llm.is_dead
            with pytest.raises(EngineDeadError, match="exited"):
                async for _ in llm.generate("more", SamplingParams()):
                    pass
        finally:
            await llm.shutdown()
        return outs, dead

    outs, dead = asyncio.run(main())
    assert [(o.text, o.token_ids, o.finish_reason) for o in outs] == expected
    assert dead.finish_reason == "error" and "exited" in dead.error


@pytest.mark.subprocess
def test_llm_on_a_process_core_equals_inline(tokenized_tiny, reference):
    _, expected = reference
    with LLM(tokenized_tiny, core="process", **COMMON) as llm:
        outs = llm.generate(prompts(12), [params(i) for i in range(12)])
    assert [(o.text, o.token_ids, o.finish_reason) for o in outs] == expected


@pytest.mark.subprocess
def test_a_core_killed_before_any_call_is_seen_dead(tokenized_tiny):
    llm = AsyncLLM(tokenized_tiny, core="process", **COMMON)
    try:
        assert not llm.is_dead
        llm._client.proc.kill()
        llm._client.proc.wait(10)
        assert llm.is_dead and "exited" in llm.dead_error
    finally:
        llm.close()


@pytest.mark.subprocess
def test_startup_failure_in_the_core_process_is_one_line(tokenized_tiny):
    with pytest.raises(ValueError, match="max_model_len=100000 exceeds"):
        AsyncLLM(tokenized_tiny, core="process", device="cpu", max_model_len=100000)


PARENT = """
import sys, time
from slipstream import AsyncLLM
llm = AsyncLLM(sys.argv[1], core="process", device="cpu", max_model_len=128)
print(llm.core_pid, flush=True)
time.sleep(60)
"""


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.subprocess
def test_idle_core_sleeps_and_exits_when_its_parent_dies(tokenized_tiny):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, tokenized_tiny], stdout=subprocess.PIPE, text=True)
    try:
        core_pid = int(parent.stdout.readline())
        time.sleep(0.5)
        c0 = _cpu_seconds(core_pid)
        time.sleep(2.0)
        assert (_cpu_seconds(core_pid) - c0) / 2.0 < 0.02  # an idle engine uses < 2% of a core
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(core_pid, 0)
            except ProcessLookupError:
                break
            try:  # reap it if it became our zombie (it is not our child: init reaps it)
                os.waitpid(core_pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.1)
        else:
            os.kill(core_pid, signal.SIGKILL)
            pytest.fail("the core process outlived its parent by 10 s")
    finally:
        parent.kill()


@pytest.mark.slow
def test_a_duplicate_request_id_fails_alone_in_the_core(tokenized_tiny):
    from slipstream.config import EngineConfig
    from slipstream.core.engine_core import EngineCore
    from slipstream.core.messages import AddRequest
    core = EngineCore(EngineConfig(model=tokenized_tiny, **COMMON))
    sp = SamplingParams(max_tokens=5, ignore_eos=True).to_dict()
    core.add(AddRequest("x", [5, 6, 7], sp))
    core.add(AddRequest("x", [8, 9], sp))
    outs = {}
    while core.has_work():
        for o in core.step():
            outs.setdefault(o.request_id, []).append(o)
    errors = [o for o in outs["x"] if o.finish_reason == "error"]
    assert len(errors) == 1 and "already in use" in errors[0].error
    assert sum(len(o.new_token_ids) for o in outs["x"]) == 5 and outs["x"][-1].finish_reason == "length"
    assert not core.requests
