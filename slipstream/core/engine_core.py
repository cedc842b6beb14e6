"""The engine core: the model, the runner, the scheduler and the overlap loop.

It knows token ids only (the front ends tokenize and detokenize).  `add` and `abort` take
the messages front ends send; `step` runs one turn of the loop and returns, for every
request that got tokens or ended, a `CoreOutput`.  A request that can never run ends with
finish_reason "error" and its message, alone.  `service.run_core` drives it from an inbox.
"""
from __future__ import annotations

import dataclasses
import os
import random
import time

import torch

from slipstream.core.tracing import Timeline
from slipstream.utils.process import collector_paused
from slipstream.config import EngineConfig, default_max_num_batched_tokens
from slipstream.core.admission import fit_error, vocabulary_error
from slipstream.core.messages import AddRequest, CoreInfo, CoreOutput
from slipstream.core.step_loop import StepLoop
from slipstream.sched.block_pool import BlockPool
from slipstream.sched.in_flight import InFlight
from slipstream.model.kv_scales import load_kv_scales
from slipstream.model.loader import load_config, load_model, resolve_dtype, resolve_model_source
from slipstream.sched.request import Request, Status
from slipstream.sched.request_table import RequestTable
from slipstream.runner.model_runner import ModelRunner, RunnerOptions
from slipstream.runner.buffer_budget import check_buffer_budget
from slipstream.runner.kv_memory import gpu_memory_in_use
from slipstream.sampling.params import SamplingParams
from slipstream.sched.scheduler import Scheduler
from slipstream.sched.speculative import SpecScheduling
from slipstream.sched.structured_outputs import StructuredOutputs
from slipstream.sampling.grammar.worker_pool import GrammarWorkerSpec
from slipstream.model.tokenizer import load_tokenizer


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but PyTorch sees no CUDA GPU")
    return torch.device(name)


class EngineCore:
    UTILITIES = ("stats", "reset_prefix_cache", "set_async_scheduling", "info")

    def __init__(self, config: EngineConfig, tokenizer=None, grammar_tokenizer=None) -> None:
        """tokenizer: the model's (loaded from the model's folder when None, except with dummy
        weights); grammar_tokenizer: the transformers tokenizer structured outputs read their
        vocabulary from, when it is not the model's (benchmarks of dummy weights)."""
        with collector_paused():
            self._build(config, tokenizer, grammar_tokenizer)

    def _build(self, config: EngineConfig, tokenizer, grammar_tokenizer) -> None:
        self.config = config
        if config.speculative_config is not None:
            SpecScheduling.check(config.speculative_config, config.tensor_parallel_size)
        self.device = resolve_device(config.device)
        self.source = resolve_model_source(config.model)
        start = time.perf_counter()
        tp = config.tensor_parallel_size
        # GPU memory others hold (e.g. replicas sharing the GPU); the ranks of a tensor-parallel
        # engine own their GPUs, and this process touches none
        self._gpu_used_at_start = gpu_memory_in_use(self.device) if tp == 1 else 0
        if tp > 1:  # the ranks load their shards (executor/)
            self.model = None
            self.model_config = load_config(self.source, config.quantization, config.load_format)
            check_tensor_parallel(self.model_config, tp, self.device)
            self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        else:
            try:
                self.model, self.model_config = load_model(self.source, config.load_format, config.dtype,
                                                           self.device, quantization=config.quantization)
            except torch.OutOfMemoryError as e:
                raise RuntimeError(f"the model does not fit: its weights alone exhaust {self.device} memory "
                                   f"({e}); use a smaller model or dtype") from None
            except RuntimeError as e:  # the host allocator's (tables sized by a huge config value)
                if "can't allocate memory" not in str(e):
                    raise
                raise ValueError(f"the model does not fit in {self.device} memory: {str(e).splitlines()[0]} "
                                 "(check the config's sizes, e.g. max_position_embeddings)") from None
            self.dtype = next(self.model.parameters()).dtype
            self.model.set_batch_invariant(config.batch_invariant)
            load_kv_scales(self.model, self.source, config.kv_cache_dtype, config.load_format)
        weights_s = time.perf_counter() - start
        self.max_model_len = self._max_model_len()
        async_mode = config.async_scheduling
        if async_mode is None:
            async_mode = self.device.type == "cuda"
        self.async_scheduling = async_mode
        tokens = config.max_num_batched_tokens or self._default_batched_tokens()
        self.max_num_batched_tokens = tokens
        if tp > 1:
            from slipstream.executor.multiproc import MultiprocExecutor
            self.runner = MultiprocExecutor(tp, self._worker_config(), self._runner_options(tokens), self.device)
        else:  # the runner itself is the executor: nothing between the loop and it
            check_buffer_budget(config.max_num_seqs, tokens, self.max_model_len, config.block_size,
                                self.model_config, self.device)
            self._drafter = self._make_drafter()
            self.runner = ModelRunner(self.model, self.model_config, self._runner_options(tokens), self.device,
                                      self.dtype)
        self.startup = self._startup_report(weights_s, time.perf_counter() - start)
        self.table = RequestTable(config.max_num_seqs, self.max_model_len, config.block_size)
        self.pool = BlockPool(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                              InFlight(), debug=config.debug_kv)
        # blocks behind the window go back early when every layer is windowed (Mistral)
        self.scheduler = Scheduler(self.pool, self.table, config.max_num_seqs, tokens,
                                   sliding_window=self.model_config.uniform_window)
        # the tokenizer's stop ids (the core needs nothing else of it; the front ends detokenize)
        if tokenizer is None and config.load_format != "dummy":
            tokenizer = load_tokenizer(self.source)
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids if tokenizer else self.model_config.eos_token_ids)
        hf_tokenizer = grammar_tokenizer if grammar_tokenizer is not None else getattr(tokenizer, "hf", None)
        # what a grammar backend is built from, here or in a grammar worker process
        grammar = GrammarWorkerSpec(config.structured_outputs_backend, hf_tokenizer,
                                    self.model_config.vocab_size, tuple(sorted(self.eos_token_ids)))
        self.scheduler.structured_outputs = StructuredOutputs(
            lambda: self._grammar_backend(grammar), self.config.structured_outputs_workers, lambda: grammar)
        if config.speculative_config is not None:
            self._setup_speculation(config.speculative_config, async_mode)
        self.timeline = Timeline() if config.trace else None
        self.loop = StepLoop(self.scheduler, self.runner, self._loop_depth(async_mode), self.timeline)
        self.requests: dict[str, Request] = {}
        self._ended: list[Request] = []  # rejected or aborted, reported by the next step
        self._seeds = random.Random(config.seed)
        self.info = CoreInfo(
            model_name=_display_name(config.model, self.source), max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size, eos_token_ids=sorted(self.eos_token_ids),
            num_kv_blocks=self.pool.num_blocks, block_size=config.block_size, device=str(self.device),
            async_scheduling=async_mode, max_num_batched_tokens=tokens)

    def _grammar_backend(self, spec: GrammarWorkerSpec):
        """The structured-outputs backend over the model's vocabulary (its logits' width)."""
        if self.config.tensor_parallel_size > 1:
            raise ValueError("they need tensor_parallel_size=1")
        if spec.hf_tokenizer is None:
            raise ValueError("the engine has no tokenizer to build token masks from "
                             f"(load_format={self.config.load_format!r} loads none)")
        from slipstream.sampling.grammar.backend import create_grammar_backend
        return create_grammar_backend(spec.backend, spec.hf_tokenizer, spec.vocab_size, spec.stop_token_ids)

    def _startup_report(self, weights_s: float, total_s: float) -> dict:
        """Where the engine's start went (seconds): the weights, the CUDA graphs and the
        rest of the runner's setup (KV sizing and allocation)."""
        graphs = getattr(self.runner, "graphs", None)  # (a tensor-parallel executor: in the workers)
        capture_s = graphs.capture_s if graphs else 0.0
        return {"weights_s": round(weights_s, 3), "graphs_s": round(capture_s, 3),
                "graph_warmups_s": round(graphs.warmup_s, 3) if graphs else 0.0,
                "num_graphs": len(graphs.graphs) if graphs else 0,
                "num_graphs_cloned": graphs.cloner.cloned if graphs and graphs.cloner else 0,
                "runner_other_s": round(total_s - weights_s - capture_s, 3), "total_s": round(total_s, 3)}

    def _runner_options(self, tokens: int) -> RunnerOptions:
        c = self.config
        return RunnerOptions(
            max_num_seqs=c.max_num_seqs, max_num_batched_tokens=tokens,
            max_model_len=self.max_model_len, block_size=c.block_size,
            num_kv_blocks=c.num_kv_blocks, gpu_memory_utilization=c.gpu_memory_utilization,
            cpu_kv_cache_gib=c.cpu_kv_cache_gib, use_cuda_graphs=not c.enforce_eager,
            cuda_graph_max_batch=c.cuda_graph_max_batch or c.max_num_seqs,
            cuda_graph_max_tokens=(tokens if c.cuda_graph_max_tokens is None else c.cuda_graph_max_tokens),
            # (a rank's graphs hold NCCL kernels, whose captured state is the capture's own)
            cuda_graph_clone=c.cuda_graph_clone and c.tensor_parallel_size == 1,
            trace=c.trace, cuda_used_at_start=self._gpu_used_at_start, kv_cache_dtype=c.kv_cache_dtype)

    def _worker_config(self) -> dict:
        """What a tensor-parallel worker needs to load its shard (plain values: sent as JSON)."""
        c = self.config
        return dict(device=self.device.type, model_source=self.source, load_format=c.load_format,
                    dtype=c.dtype, batch_invariant=c.batch_invariant, quantization=c.quantization,
                    kv_cache_dtype=c.kv_cache_dtype)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (a one-rank engine holds nothing to stop)."""
        self.scheduler.structured_outputs.close()
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def _default_batched_tokens(self) -> int:
        if self.device.type != "cuda":
            return default_max_num_batched_tokens("cpu", max_num_seqs=self.config.max_num_seqs)
        props = torch.cuda.get_device_properties(self.device)
        return default_max_num_batched_tokens("cuda", props.total_memory, props.name,
                                              self.config.max_num_seqs)

    def _max_model_len(self) -> int:
        cfg = self.model_config
        limit = cfg.max_model_len
        if self.config.max_model_len is None:
            return limit
        if self.config.max_model_len > limit:
            raise ValueError(f"max_model_len={self.config.max_model_len} exceeds what the model supports "
                             f"({limit} positions)")
        return self.config.max_model_len

    # -- requests ---------------------------------------------------------------------
    def add(self, msg: AddRequest) -> None:
        """Queue a request the front end validated (`frontend.prompts.validate_request`).
        The core's own guard: the parameters name exactly SamplingParams' fields, the request
        fits the context and the KV cache, its ids are inside the vocabulary (one pass, which
        costs microseconds beside the step) and its row's values fit the request table. One
        that fails it (or whose id is in use) ends alone at the next step with finish_reason
        "error"; add never raises for a request, which would kill the engine."""
        rid = msg.request_id
        if rid in self.requests:
            self._ended.append(Request(rid, [], SamplingParams(), 0, status=Status.FINISHED,
                                       finish_reason="error", error=f"request id {rid!r} is already in use"))
            return
        try:
            params = SamplingParams.from_validated(msg.params)
            error = fit_error(len(msg.prompt_token_ids), params.max_tokens, self.info)
            seed = msg.seed if msg.seed is not None else (
                params.seed if params.seed is not None else self._seeds.getrandbits(63))
            seed %= 1 << 63
            req = Request(rid, msg.prompt_token_ids, params, seed, self.eos_token_ids,
                          arrival_time=msg.arrival_time)
            # a value the request table cannot store would fail the step that admits the
            # request, and so every request: it fails here, alone
            error = error or vocabulary_error(msg.prompt_token_ids, self.info.vocab_size)
            if not error:
                self.table.row_values(req)
        except Exception as e:  # noqa: BLE001 - a malformed request fails alone
            error = f"malformed request: {type(e).__name__}: {e}"
            req = Request(rid, [], SamplingParams(), 0, self.eos_token_ids, arrival_time=msg.arrival_time)
        self.requests[rid] = req
        if not error and req.params.structured_outputs is not None:
            error = self.scheduler.structured_outputs.submit(req)
        if error:
            req.status, req.finish_reason, req.error = Status.FINISHED, "error", error
            self._ended.append(req)
            return
        self.scheduler.add(req)

    def abort(self, request_ids) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.finished:
                continue
            self.scheduler.finish(req, "abort")
            self._ended.append(req)

    def has_work(self) -> bool:
        return bool(self.scheduler.has_unfinished() or self.loop.in_flight or self._ended)

    # -- the loop ---------------------------------------------------------------------
    def step(self) -> list[CoreOutput]:
        """One turn of the overlap loop: the news of every request that got tokens or ended."""
        ended, self._ended = self._ended, []
        for req, error in self.scheduler.structured_outputs.poll():  # grammars that failed
            self.scheduler.finish(req, "error", error)
            ended.append(req)
        touched = self.loop.step()
        # e.g. blocks held elsewhere; fail the head alone, the rest goes on
        if self.loop.stuck and not self.scheduler.waiting[0].awaiting_grammar:
            req = self.scheduler.waiting[0]
            self.scheduler.finish(req, "error", "the scheduler could not place this request "
                                                "(it needs more KV blocks or rows than are free)")
            touched.append(req)
        elif self.loop.stuck and not ended and not touched:
            time.sleep(0.001)  # only grammars compiling: let their threads run
        return [self._output(r) for r in ended + touched]

    def _output(self, req: Request) -> CoreOutput:
        new = req.output_token_ids[req.num_emitted:]
        out = CoreOutput(req.request_id, new)
        if req.logprobs is not None and new:
            out.new_logprobs = req.logprobs[req.num_emitted:]
        req.num_emitted = len(req.output_token_ids)
        if len(req.prompt_logprobs) > req.num_prompt_logprobs_emitted:
            out.new_prompt_logprobs = req.prompt_logprobs[req.num_prompt_logprobs_emitted:]
            req.num_prompt_logprobs_emitted = len(req.prompt_logprobs)
        if req.queue_time is not None and not req.queue_time_sent:
            out.queue_time, req.queue_time_sent = req.queue_time, True
        if req.finished:
            out.finish_reason, out.error, out.stop_token = req.finish_reason, req.error, req.stop_token
            if self.requests.get(req.request_id) is req:  # (not a duplicate id's rejection)
                del self.requests[req.request_id]
        return out

    def fail_all(self, message: str) -> list[CoreOutput]:
        """The engine died: an error output for every open request (nothing more runs)."""
        outs = [CoreOutput(rid, [], finish_reason="error", error=message) for rid in self.requests]
        self.requests.clear()
        return outs

    # -- utilities --------------------------------------------------------------------
    def stats(self) -> dict:
        s, pool = self.scheduler, self.pool
        in_use = len({b for r in s.running for b in r.block_ids[r.num_freed_blocks:]})
        queries = pool.num_queries
        return dict(num_running=len(s.running), num_waiting=len(s.waiting), kv_blocks_total=pool.num_blocks,
                    kv_blocks_in_use=in_use, kv_cache_usage=in_use / pool.num_blocks,
                    num_preemptions=s.num_preemptions, prefix_cache_queries=queries,
                    prefix_cache_hits=pool.num_hits,
                    prefix_cache_hit_rate=pool.num_hits / queries if queries else 0.0,
                    **dataclasses.asdict(self.scheduler.structured_outputs.stats()),
                    **(s.speculative.stats.as_dict() if s.speculative is not None else {}))

    def _setup_speculation(self, spec_config, async_mode: bool) -> None:
        spec = self.scheduler.speculative = SpecScheduling(spec_config, self.max_model_len)
        spec.device = async_mode  # (drafts made on the GPU)
        spec.drafter = self.runner.drafter = self._drafter

    def _make_drafter(self):
        """draft_model, eagle3: the drafter that runs on the device after every step (None:
        ngram or no speculation).  Made before the runner sizes its KV cache from the memory
        left, so that its weights, KV and buffers count against `gpu_memory_utilization`."""
        spec_config = self.config.speculative_config
        if spec_config is None or spec_config.method not in ("draft_model", "eagle3"):
            return None
        rows = self.config.max_num_seqs + 1  # (the request table's rows)
        common = (rows, self.max_model_len, self.config.block_size, self.device, self.dtype,
                  spec_config.num_speculative_tokens)
        if spec_config.method == "draft_model":
            from slipstream.runner.draft_model import DraftModelDrafter
            return DraftModelDrafter(spec_config.model, self.model_config.vocab_size, *common)
        from slipstream.runner.eagle3_drafter import Eagle3Drafter
        return Eagle3Drafter(spec_config.model, self.model, self.model_config, *common)

    def set_bench_synthetic_acceptance(self, accept: float) -> None:
        """A benchmark knob (`slipstream bench --spec-synthetic-accept`, nothing else sets
        it): every verification step accepts the first min(accept, drafted) drafts whatever
        the target says, and every row drafts k (n-gram misses repeat the last token), so
        tokens/s against tokens per step can be measured with dummy weights.  The emitted
        tokens are then not the model's.  A fractional `accept` accepts one more on that
        fraction of the steps (2.5: 3.5 tokens a step on average)."""
        spec = self.scheduler.speculative
        if spec is None:
            raise ValueError("--spec-synthetic-accept needs --speculative-config")
        if not 0 <= accept <= spec.k:
            raise ValueError(f"--spec-synthetic-accept must be in [0, num_speculative_tokens={spec.k}], got {accept}")
        spec.bench_synthetic_accept = accept

    def _loop_depth(self, async_mode: bool) -> int:
        """2: the overlap loop (every drafter drafts on the device), 1: the sync baseline."""
        return 2 if async_mode else 1

    def set_async_scheduling(self, enabled: bool) -> None:
        """Switch between the overlap loop (depth 2) and the sync baseline (depth 1)."""
        if self.loop.in_flight:
            raise RuntimeError("cannot switch modes while batches are in flight")
        self.async_scheduling = enabled
        self.loop.depth = self._loop_depth(enabled)
        if self.scheduler.speculative is not None:
            self.scheduler.speculative.device = enabled

    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes (benchmarks run the same prompts twice)."""
        if self.has_work():
            raise RuntimeError("cannot reset the prefix cache while requests run")
        self.pool.reset_prefix_cache()

    def call(self, method: str, args: list):
        if method not in self.UTILITIES:
            raise ValueError(f"unknown engine call {method!r}; known: {', '.join(self.UTILITIES)}")
        if method == "info":
            return {f: getattr(self.info, f) for f in self.info.__struct_fields__}
        return getattr(self, method)(*args)


def check_parallel_config(config: EngineConfig) -> None:
    """`check_tensor_parallel` from the model's config alone (cheap: no weights are read)."""
    if config.tensor_parallel_size > 1:
        check_tensor_parallel(load_config(resolve_model_source(config.model)), config.tensor_parallel_size,
                              resolve_device(config.device))


def check_tensor_parallel(model_config, tp: int, device: torch.device) -> None:
    """One-line errors, before any worker starts: head counts that do not split, too few GPUs."""
    from slipstream.model.parallel import check_tensor_parallel as check_heads
    check_heads(model_config, tp)
    if device.type == "cuda" and torch.cuda.device_count() < tp:
        raise ValueError(f"tensor_parallel_size={tp} needs {tp} GPUs; PyTorch sees {torch.cuda.device_count()}")


def _display_name(model: str | None, source: str) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(model)) or model
