"""The engine on a CUDA GPU (marked `gpu`; run on the H200): the fast path against the
CPU engine (fp32, token for token) and against transformers (bf16 logits), and async
against sync with CUDA graphs replayed on both IO slots."""
import copy

import numpy as np
import pytest
import torch
from async_mix import make_tokenized_tiny_llama, mix, run_mix
from helpers import PagedModelRunner

from slipstream import LLM, SamplingParams
from slipstream.model.loader import load_model

pytestmark = pytest.mark.gpu


def prompts_for(tokenizer) -> list[list[int]]:
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Write a short poem about the sea."}])
    return [chat, tokenizer.encode("The history of the Roman Empire"), tokenizer.encode("import numpy as np\n")]


def assert_graphs_replayed(llm, both_slots=False) -> None:
    """Decode graphs replayed (on both IO slots), and mixed-step graphs too."""
    replays = llm.engine.runner.graph_replays
    assert (min if both_slots else sum)(replays["decode"]) > 0, replays
    assert sum(replays["mixed"]) > 0, replays


def test_smollm2_fp32_gpu_equals_cpu_engine():
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    cpu = LLM(device="cpu", max_model_len=512)
    prompts = prompts_for(cpu.tokenizer)
    ref = [o.token_ids for o in cpu.generate(prompts, params)]
    for async_scheduling in (False, True):
        gpu = LLM(device="cuda", dtype="float32", max_model_len=512, max_num_seqs=8,
                  async_scheduling=async_scheduling)
        assert [o.token_ids for o in gpu.generate(prompts, params)] == ref
        assert_graphs_replayed(gpu)
        del gpu
        torch.cuda.empty_cache()


@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
def test_tiny_fp32_gpu_equals_cpu_engine(tiny_model, kind):
    folder, _ = tiny_model(kind)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (4, 17, 33, 60)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in LLM(folder, device="cpu", max_model_len=256).generate(prompts, params)]
    gpu = LLM(folder, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8)
    assert [o.token_ids for o in gpu.generate(prompts, params)] == ref
    assert_graphs_replayed(gpu)


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3"])
def test_one_row_steps_fp32_gpu_equal_cpu_engine(tiny_model, kind):
    """A single request: every decode step has one row, which takes the GEMV path (the folded
    norm's row scale and the qkv bias inside the products, SiLU·mul inside the down GEMV)."""
    folder, _ = tiny_model(kind)
    prompt = np.random.default_rng(3).integers(3, 256, 21).tolist()
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    ref = LLM(folder, device="cpu", max_model_len=256).generate([prompt], params)[0].token_ids
    gpu = LLM(folder, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8)
    assert gpu.generate([prompt], params)[0].token_ids == ref
    assert_graphs_replayed(gpu)


def bf16_logits_vs_transformers(model, hf, prompt: list[int]):
    """(ours, transformers' bf16, transformers' fp32) float32 logits of `prompt` on the GPU."""
    ids = torch.tensor([prompt], device="cuda")
    ours = PagedModelRunner(model, block_size=16).step([(0, prompt)])
    with torch.no_grad():
        truth = hf.to("cuda")(ids).logits[0].float()  # hf is fp32: moved, not rounded
        ref = copy.deepcopy(hf).to(torch.bfloat16)(ids).logits[0].float()
    hf.to("cpu")
    return ours, ref, truth


def assert_bf16_as_accurate_as_transformers(ours, ref, truth):
    # Both bf16 models differ from the fp32 truth by their rounding; ours (folded norms, the
    # residual add inside the GEMM) must be about as close to it as transformers' own bf16
    # run, and close to that run.
    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()
    err_ours, err_hf, err_pair = rel(ours, truth), rel(ref, truth), rel(ours, ref)
    msg = f"ours vs fp32 {err_ours:.4f}, transformers bf16 vs fp32 {err_hf:.4f}, ours vs it {err_pair:.4f}"
    assert err_ours <= 1.5 * err_hf + 2e-3, msg
    assert err_pair < 3e-2, msg


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3"])
def test_bf16_logits_close_to_transformers(tiny_model, kind):
    folder, hf = tiny_model(kind)
    model, _ = load_model(folder, dtype="bfloat16", device="cuda")
    assert_bf16_as_accurate_as_transformers(
        *bf16_logits_vs_transformers(model, hf, np.random.default_rng(1).integers(3, 256, 100).tolist()))


def test_smollm2_bf16_logits_close_to_transformers(smollm2_transformers):
    model, _ = load_model(None, dtype="bfloat16", device="cuda")
    prompt = np.random.default_rng(2).integers(3, 49000, 300).tolist()
    ours, ref, truth = bf16_logits_vs_transformers(model, smollm2_transformers, prompt)
    assert_bf16_as_accurate_as_transformers(ours, ref, truth)
    assert (ours.argmax(-1) == truth.argmax(-1)).float().mean() >= (ref.argmax(-1) == truth.argmax(-1)).float().mean() - 0.05
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


@pytest.fixture(scope="module")
def tokenized_tiny(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny-tok"))
    make_tokenized_tiny_llama(folder)
    return folder


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("dtype,batch_invariant", [("float32", False), ("bfloat16", True)])
def test_async_equals_sync_on_the_mixed_workload_with_graphs_on_both_slots(tokenized_tiny, sampled, dtype,
                                                                           batch_invariant):
    """EOS, stop strings, aborts, staggered arrivals, prefix hits and preemption.

    The two modes batch differently here (a stopped row stays one more step in async).  In
    fp32 a row's result does not depend on its batch anyway, so the strict comparison checks
    the pipeline itself (placeholders, carry-over, dropped tokens); in bf16 it holds with
    batch_invariant=True (batch-invariant GEMMs and one attention kernel for every row).
    """
    reqs = mix(tokenized_tiny, sampled=sampled)
    common = dict(device="cuda", dtype=dtype, max_model_len=256, max_num_seqs=12, num_kv_blocks=24,
                  max_num_batched_tokens=64, debug_kv=True, batch_invariant=batch_invariant)
    sync = LLM(tokenized_tiny, async_scheduling=False, **common)
    asyn = LLM(tokenized_tiny, async_scheduling=True, **common)
    got = run_mix(sync, reqs)
    assert got == run_mix(asyn, reqs)
    assert {r for _, _, r in got.values()} == {"stop", "length", "abort"}
    for llm in (sync, asyn):
        assert_graphs_replayed(llm, both_slots=True)
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_async_equals_sync_smollm2_bf16(temperature):
    """Real size, bf16, CUDA graphs: 40 requests of different lengths, all running at once.

    Batches are then the same in both modes (max_tokens is known ahead, so no row is
    scheduled past its end), and so are the tokens, greedy or seeded.  (When a request
    stops on EOS, async keeps its row one more step and bf16 GEMMs may round a row
    differently in a batch of another size: see docs/architecture.md.)
    """
    llm = LLM(device="cuda", dtype="bfloat16", max_model_len=1024, max_num_seqs=48)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 49000, int(n)).tolist() for n in rng.integers(5, 400, 40)]
    params = [SamplingParams(max_tokens=int(m), temperature=temperature, seed=i, ignore_eos=True)
              for i, m in enumerate(rng.integers(8, 96, 40))]
    llm.engine.set_async_scheduling(False)
    sync = [o.token_ids for o in llm.generate(prompts, params)]
    llm.engine.reset_prefix_cache()
    llm.engine.set_async_scheduling(True)
    asyn = [o.token_ids for o in llm.generate(prompts, params)]
    same = sum(a == b for a, b in zip(sync, asyn))
    assert same == len(prompts), f"{same}/{len(prompts)} identical"
    assert_graphs_replayed(llm, both_slots=True)


QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?",
             "Say hello in Spanish.", "Who wrote Hamlet?", "What is water made of?",
             "Give me a synonym for happy.", "What day comes after Monday?",
             "Write one sentence about cats.", "What is the largest planet?",
             "Translate 'thank you' to French.", "List two fruits."]


def chat_sync_then_async(llm, temperature: float) -> tuple[list, list]:
    """QUESTIONS three times as chats ending on EOS, a stop string or max_tokens at different
    steps, run in sync mode then in async mode: (token ids, finish reason) per request, each."""
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS * 3]
    params = [SamplingParams(max_tokens=[12, 40, 80][i % 3], temperature=temperature, seed=i,
                             stop=["."] if i % 4 == 0 else None) for i in range(len(convs))]
    llm.engine.set_async_scheduling(False)
    sync = [(o.token_ids, o.finish_reason) for o in llm.chat(convs, params)]
    llm.engine.reset_prefix_cache()
    llm.engine.set_async_scheduling(True)
    asyn = [(o.token_ids, o.finish_reason) for o in llm.chat(convs, params)]
    return sync, asyn


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_async_equals_sync_smollm2_bf16_batch_invariant(temperature):
    """Real size, bf16, graphs: 36 chat requests that end on EOS, stop strings or max_tokens
    at different steps, so sync and async run batches of different sizes; with
    batch_invariant=True the tokens are still the same, greedy or seeded."""
    llm = LLM(device="cuda", dtype="bfloat16", max_model_len=1024, max_num_seqs=16, batch_invariant=True)
    sync, asyn = chat_sync_then_async(llm, temperature)
    assert {r for _, r in sync} == {"stop", "length"}
    same = sum(a == b for a, b in zip(sync, asyn))
    assert same == len(sync), f"{same}/{len(sync)} identical"
    assert_graphs_replayed(llm, both_slots=True)


def test_top_p_graphs_captured_lazily_match_eager(tiny_model):
    """The top-k/top-p sampler variant is not captured at start: a shape runs eagerly on
    its first use and replays a graph captured at its second; tokens equal the eager engine."""
    folder, _ = tiny_model("llama3")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 12, 30)]
    params = [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    opts = dict(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8)
    ref = [o.token_ids for o in LLM(folder, enforce_eager=True, **opts).generate(prompts, params)]
    gpu = LLM(folder, **opts)
    graphs = gpu.engine.runner.graphs
    assert not any(key[4] for key in graphs.graphs), "no top-k/top-p graph at start"
    assert [o.token_ids for o in gpu.generate(prompts, params)] == ref
    assert any(key[4] for key in graphs.graphs), "top-k/top-p graphs captured on their second use"
    assert sum(gpu.engine.runner.graph_replays["decode"]) > 0
