"""The engine: the step loop, and the offline `LLM` API on top of it.

One step = schedule batch N+1 and launch it, then (async) collect batch N, whose GPU
work ran while the CPU scheduled and built N+1.  With depth 1 (sync) the step collects
the batch it just launched: the same engine, the baseline.
"""
from __future__ import annotations

import atexit
import gc
import itertools
import random
import time
from collections import deque

import torch

from slipstream.bench.timeline import Timeline
from slipstream.config import EngineConfig, default_max_num_batched_tokens
from slipstream.kv_cache import BlockPool, InFlight
from slipstream.model.loader import load_model, resolve_model_source
from slipstream.request import Request, RequestOutput, Status
from slipstream.request_table import RequestTable
from slipstream.runner.model_runner import ModelRunner, RunnerOptions
from slipstream.sampling_params import SamplingParams
from slipstream.scheduler import Scheduler
from slipstream.tokenizer import load_tokenizer


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but PyTorch sees no CUDA GPU")
    return torch.device(name)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        source = resolve_model_source(config.model)
        try:
            self.model, self.model_config = load_model(source, config.load_format, config.dtype, self.device)
        except torch.OutOfMemoryError as e:
            raise RuntimeError(f"the model does not fit: its weights alone exhaust {self.device} memory "
                               f"({e}); use a smaller model or dtype") from None
        self.dtype = next(self.model.parameters()).dtype
        self.model.set_batch_invariant(config.batch_invariant)
        self.tokenizer = None if config.load_format == "dummy" else load_tokenizer(source)
        self.max_model_len = self._max_model_len()
        async_mode = config.async_scheduling
        if async_mode is None:
            async_mode = self.device.type == "cuda"
        self.async_scheduling = async_mode
        tokens = config.max_num_batched_tokens or self._default_batched_tokens()
        self.max_num_batched_tokens = tokens
        opts = RunnerOptions(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=tokens,
            max_model_len=self.max_model_len, block_size=config.block_size,
            num_kv_blocks=config.num_kv_blocks, gpu_memory_utilization=config.gpu_memory_utilization,
            cpu_kv_cache_gib=config.cpu_kv_cache_gib, use_cuda_graphs=not config.enforce_eager,
            cuda_graph_max_batch=config.cuda_graph_max_batch or config.max_num_seqs,
            cuda_graph_max_tokens=(tokens if config.cuda_graph_max_tokens is None
                                   else config.cuda_graph_max_tokens),
            trace=config.trace)
        self.runner = ModelRunner(self.model, self.model_config, opts, self.device, self.dtype)
        self.table = RequestTable(config.max_num_seqs, self.max_model_len, config.block_size)
        self.pool = BlockPool(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                              InFlight(), debug=config.debug_kv)
        self.scheduler = Scheduler(self.pool, self.table, config.max_num_seqs, tokens)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids if self.tokenizer else
                                       self.model_config.eos_token_ids)
        self.timeline = Timeline() if config.trace else None
        self.loop = StepLoop(self.scheduler, self.runner, 2 if async_mode else 1, self.timeline)
        self.requests: dict[str, Request] = {}
        self._ended: list[Request] = []  # rejected or aborted, reported by the next step
        self._ids = itertools.count()
        self._seeds = random.Random(config.seed)

    def _default_batched_tokens(self) -> int:
        if self.device.type != "cuda":
            return default_max_num_batched_tokens("cpu", max_num_seqs=self.config.max_num_seqs)
        props = torch.cuda.get_device_properties(self.device)
        return default_max_num_batched_tokens("cuda", props.total_memory, props.name,
                                              self.config.max_num_seqs)

    def _max_model_len(self) -> int:
        cfg = self.model_config
        limit = cfg.max_position_embeddings
        if cfg.sliding_window:  # attention is exact while the context fits in the window
            limit = min(limit, cfg.sliding_window)
        if self.config.max_model_len is None:
            return limit
        if self.config.max_model_len > limit:
            raise ValueError(f"max_model_len={self.config.max_model_len} exceeds what the model supports "
                             f"({limit} positions)")
        return self.config.max_model_len

    # -- requests ---------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self._tokenize(prompt)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        req = Request(request_id, token_ids, params, seed % (1 << 63), self.eos_token_ids, prompt=text)
        self.requests[request_id] = req
        error = self._admission_error(req)
        if error:
            req.status, req.finish_reason, req.error = Status.FINISHED, "error", error
            self._ended.append(req)
            return request_id
        if params.stop and self.tokenizer is not None:
            from slipstream.detokenizer import IncrementalDetokenizer
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params.stop,
                                                     params.skip_special_tokens, min_tokens=params.min_tokens)
        self.scheduler.add(req)
        return request_id

    def _tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (dummy weights or no tokenizer files): "
                                 "pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt)
        # (the distinct element types, not every element: 256 x 1,000-token prompts cost
        # ~0.1 s through a per-token isinstance loop)
        if isinstance(prompt, (list, tuple)) and all(issubclass(t, int) and t is not bool
                                                     for t in set(map(type, prompt))):
            return list(prompt)
        raise TypeError("a prompt must be a string or a list of token ids (ints), "
                        f"got {type(prompt).__name__}")

    def _admission_error(self, req: Request) -> str | None:
        n, max_tokens = len(req.prompt_token_ids), req.params.max_tokens
        vocab = self.model_config.vocab_size
        if n == 0:
            return "the prompt is empty"
        ids = req.prompt_token_ids
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(t for t in ids if not 0 <= t < vocab)
            return f"prompt token id {bad} is outside the vocabulary [0, {vocab})"
        if n + max_tokens > self.max_model_len:
            return (f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) is {n + max_tokens} tokens, "
                    f"more than max_model_len={self.max_model_len}")
        blocks = -(-(n + max_tokens) // self.config.block_size)
        if blocks > self.pool.num_blocks:
            return (f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) needs {blocks} KV blocks, "
                    f"but the whole KV cache has {self.pool.num_blocks}")
        return None

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        self.scheduler.finish(req, "abort")
        self._ended.append(req)

    def set_async_scheduling(self, enabled: bool) -> None:
        """Switch between the overlap loop (depth 2) and the sync baseline (depth 1)."""
        if self.loop.in_flight:
            raise RuntimeError("cannot switch modes while batches are in flight")
        self.async_scheduling = enabled
        self.loop.depth = 2 if enabled else 1

    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes (benchmarks run the same prompts twice)."""
        if self.has_unfinished_requests():
            raise RuntimeError("cannot reset the prefix cache while requests run")
        self.pool.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.has_unfinished() or self.loop.in_flight or self._ended)

    # -- the loop ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One turn of the overlap loop; returns the requests that finished."""
        finished, self._ended = self._ended, []
        finished += self.loop.step()
        return [self._output(r) for r in finished]

    def _output(self, req: Request) -> RequestOutput:
        self.requests.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids), text=self._text(req), finished=True,
            finish_reason=req.finish_reason, logprobs=req.logprobs, error=req.error, prompt=req.prompt)

    def _text(self, req: Request) -> str:
        if self.tokenizer is None or not req.output_token_ids:
            return ""
        if req.detokenizer is not None:
            return req.detokenizer.final_text()
        ids = req.output_token_ids
        p = req.params
        if req.finish_reason == "stop" and (ids[-1] in p.stop_token_ids or
                                            (not p.ignore_eos and ids[-1] in req.eos_token_ids)):
            ids = ids[:-1]  # the stop token ends the text, it is not part of it
        return self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)

    def run_until_done(self, on_finish=None) -> list[RequestOutput]:
        outputs = []
        while self.has_unfinished_requests():
            for out in self.step():
                outputs.append(out)
                if on_finish:
                    on_finish(out)
        return outputs


class StepLoop:
    """The overlap loop.  Each step schedules batch N+1 and launches it, then, once
    `depth` batches are in flight, blocks on the oldest (N) and hands its tokens to the
    scheduler.  The GPU computes N while the CPU schedules and builds N+1.  depth=1 is
    the synchronous baseline: launch, wait, process, in turn."""

    def __init__(self, scheduler: Scheduler, runner, depth: int, timeline: Timeline | None = None) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.depth = depth
        self.timeline = timeline
        self.in_flight: deque = deque()
        self.num_batches = 0

    def step(self) -> list[Request]:
        tl = self.timeline
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        t1 = time.perf_counter()
        if batch is not None:
            self.in_flight.append(self.runner.launch(batch))
            self.num_batches += 1
            if tl:
                tl.batch(batch)
                tl.cpu("schedule", t0, t1, batch.batch_id)
                tl.cpu("launch", t1, time.perf_counter(), batch.batch_id)
        elif not self.in_flight and self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler could not schedule any waiting request")
        if not self.in_flight or (batch is not None and len(self.in_flight) < self.depth):
            return []
        done = self.in_flight.popleft()
        t2 = time.perf_counter()
        result = self.runner.wait(done)
        t3 = time.perf_counter()
        touched = self.scheduler.update(done.batch, result)
        if tl:
            tl.cpu("wait", t2, t3, done.batch.batch_id)
            tl.cpu("process", t3, time.perf_counter(), done.batch.batch_id)
            if getattr(done, "gpu_times", None):
                tl.gpu(done.batch.batch_id, done.gpu_times)
        return [r for r in touched if r.finished]


def freeze_gc() -> None:
    """Take everything alive now (model, CUDA graphs, imported modules: hundreds of thousands
    of objects) out of the garbage collector's reach, for a process that keeps one engine.

    Python's full collections scan every tracked object. While requests arrive their lists
    trigger such collections, and scanning the startup heap with them stalls the CPU that
    feeds the GPU (docs/benchmarks.md, "Garbage collector"). Frozen objects are never
    scanned again, and not collected until the process exits (they are thawed then, so
    extension modules see their objects released). Call it once the engine is built and
    warmed up, in processes that run one engine (the CLI and `slipstream bench` do).
    """
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often this is called
    atexit.register(gc.unfreeze)


class LLM:
    """Offline batch inference: `LLM(model).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | None = None, **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this model has none")
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        prompts = [self.tokenizer.apply_chat_template(conv) for conv in messages]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generating", unit="req")
        done = {}
        for out in self.engine.run_until_done(on_finish=(lambda _: bar.update(1)) if bar else None):
            done[out.request_id] = out
        if bar:
            bar.close()
        return [done[i] for i in ids]


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; "
                        f"got {type(prompts).__name__}")
    return list(prompts)


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
