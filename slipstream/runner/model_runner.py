"""The model runner: turns a scheduled batch into device work, and tokens back.

`launch` fills one of two IO slots, then issues three pieces of work, each on its own
stream and ordered by events: upload (h2d), step (compute: carry-over, forward,
sampling), download (d2h).  It returns at once; `wait` blocks on the download of that
batch only.  A batch replays its slot's CUDA graph for its padded sizes (runner/graphs.py)
when one fits; others run eagerly.  On the CPU the streams and events are no-ops and the
same calls run one after the other.

Setup is three phases (`setup` runs them in turn; a tensor-parallel worker runs them one by
one, because the KV pool takes the smallest block count over the ranks): the KV block
count (`kv_blocks_that_fit`, profiling on CUDA), `allocate`, `capture`. `launch` is the
host half (inputs from the batch) then `issue` (the device work), which a worker runs on
inputs it received.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from slipstream.ops.metadata import AttentionMetadata
from slipstream.ops.carry import carry_over
from slipstream.runner.draft_step import launch_device_drafting
from slipstream.runner.graphs import step_graphs
from slipstream.runner.inputs import StepPad, StepShape, fill_inputs, pad_batch
from slipstream.ops.kv_quant import kv_cache_torch_dtype
from slipstream.runner.kv_memory import KVCacheSpec, allocate_kv_caches, num_kv_blocks
from slipstream.runner.pipeline import Streams
from slipstream.runner.prompt_logprobs import PromptSpan, score_prompt_spans, step_prompt_spans
from slipstream.runner.slots import IOSlot
from slipstream.runner.split_graphs import SplitGraphs
from slipstream.runner.speculative import launch_speculative
from slipstream.sampling.sampler import PenaltyState, SamplingTensors, sample
from slipstream.sampling.columns import ALL_COLUMNS
from slipstream.sched.batch import BatchResult, ScheduledBatch


@dataclass
class Launched:
    batch: ScheduledBatch | None  # None in a tensor-parallel worker (it has inputs, no batch)
    slot: IOSlot
    num_samples: int
    num_logprobs: int
    gpu_times: dict | None = None  # filled by wait() when tracing
    prompt_logprobs: list | None = None  # device (logprobs, ids) per batch.prompt_logprobs entry
    # a batch with structured-output rows: its forward is queued (its sampled rows' hidden
    # states wait in the slot's `sample_hidden`), its sampling waits for its token bitmask
    # (`finish_launch`); the step's shape until then
    pending_shape: StepShape | None = None
    # a batch with drafts: pinned host (emitted tokens [S, k + 1], their counts [S], drafts
    # verified [S]) (runner/speculative.py)
    spec_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    spec_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None  # [S, k + 1, 1 + n], [S, k + 1, n]

    @property
    def needs_mask(self) -> bool:
        return self.pending_shape is not None


@dataclass
class RunnerOptions:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int | None
    gpu_memory_utilization: float
    cpu_kv_cache_gib: float
    use_cuda_graphs: bool
    cuda_graph_max_batch: int
    cuda_graph_max_tokens: int  # largest mixed-step graph (0: mixed steps run eagerly)
    trace: bool
    # the second IO slot's graphs cloned from the first's, not captured (runner/graph_clone.py)
    cuda_graph_clone: bool = True
    cuda_used_at_start: int = 0  # GPU bytes in use before the engine loaded (kv_memory.kv_budget)
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype: the model's dtype or fp8 (e4m3)


class ModelRunner:
    def __init__(self, model, model_config, opts: RunnerOptions, device: torch.device,
                 dtype: torch.dtype, setup: bool = True) -> None:
        self.model = model
        self.model_config = model_config
        self.opts = opts
        self.device = device
        self.dtype = dtype
        self.block_size = opts.block_size
        self.max_model_len = opts.max_model_len
        self.streams = Streams(device, timing=opts.trace)
        self.slots = [self.new_slot(i) for i in range(2)]
        self.penalties = PenaltyState(opts.max_num_seqs + 1, model_config.vocab_size, device)
        # this rank's KV heads (all of them without tensor parallelism)
        self.num_kv_heads = getattr(model, "num_local_kv_heads", model_config.num_kv_heads)
        self.kv_spec = KVCacheSpec(model_config.num_layers, opts.block_size, self.num_kv_heads,
                                   model_config.head_dim, kv_cache_torch_dtype(opts.kv_cache_dtype, dtype))
        # the decode kernel's split-merge counters (zero between launches; one per row x KV head)
        self.split_counters = torch.zeros(opts.max_num_seqs * self.num_kv_heads,
                                          dtype=torch.int32, device=device)
        self.split_policy = self._split_policy()
        self.graphs = step_graphs(opts, device, self.split_policy)
        # constrained steps' forward and sampling graphs (runner/split_graphs.py)
        self.split_graphs = SplitGraphs(self.graphs) if self.graphs is not None else None
        self.graph_replays = {"decode": [0, 0], "mixed": [0, 0]}  # per slot
        self.trace_origin = None
        # a drafter that runs after every step (runner/device_drafter.py), set by the engine core
        self.drafter = None
        if setup:
            self.setup()

    def new_slot(self, index: int) -> IOSlot:
        """An IO slot for this runner's largest step."""
        opts = self.opts
        max_tokens = max(opts.max_num_batched_tokens, opts.max_num_seqs)
        max_blocks = -(-opts.max_model_len // opts.block_size)
        return IOSlot(index, max_tokens, opts.max_num_seqs, max_blocks, self.device, self.streams)

    def setup(self) -> None:
        self.allocate(self.kv_blocks_that_fit())
        self.capture()

    def kv_blocks_that_fit(self) -> int:
        """Setup phase 1: the KV blocks this device holds (CUDA: after a profiling step)."""
        return num_kv_blocks(self, self.kv_spec, self.opts)

    def allocate(self, num_blocks: int) -> None:
        """Setup phase 2: the KV cache."""
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_caches(self.kv_spec, num_blocks, self.device)

    def capture(self) -> None:
        """Setup phase 3: the CUDA graphs (none on the CPU), and the trace's time origin."""
        if self.graphs is not None:
            self.graphs.capture_all(self)
        opts = self.opts
        if opts.trace:
            self.streams.synchronize()
            self.trace_origin = (self.streams.event(), time.perf_counter())
            self.trace_origin[0].record(self.streams.compute)

    def _split_policy(self):
        """The decode attention's per-step split choice (CUDA; none elsewhere, and none in
        batch-invariant mode, whose decode rows take the prefill kernel)."""
        if self.device.type != "cuda" or getattr(self.model, "batch_invariant", False):
            return None
        from slipstream.ops import triton_attention as ta
        from slipstream.ops.device import sm_count
        c = self.model_config
        cfg = ta.effective_decode_config(ta.DEFAULT_DECODE_CONFIG, self.dtype, c.head_dim)
        return ta.DecodeSplitPolicy(self.num_kv_heads, self.max_model_len, cfg, sm_count(self.device))

    def decode_splits(self, host, num_rows: int, num_seqs: int) -> int | None:
        """The split count of a decode batch of `num_rows` real rows padded to `num_seqs`."""
        if self.split_policy is None:
            return None
        return self.split_policy.pick(host.seq_lens[:num_rows], num_seqs)

    # -- the step on the compute stream (eager, or captured into a graph) ---------------
    def compute_step(self, slot: IOSlot, shape: StepShape, suppress=None, prompt_spans=None) -> list | None:
        """The step's work on the compute stream; with `prompt_spans` (eager only) also the
        prompt logprobs of those spans, returned as device tensors."""
        hidden = self.forward_hidden(slot, shape)
        prompt_lps = self.prompt_logprobs(hidden, prompt_spans) if prompt_spans else None
        logits = self.logits(slot, shape, hidden)
        if suppress:
            rows = [r for r, ids in suppress for _ in ids]
            cols = [t for _, ids in suppress for t in ids]
            logits[torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device)] = float("-inf")
        self.sample(slot, shape, logits)
        return prompt_lps

    def forward_to_hidden(self, slot: IOSlot, shape: StepShape, prompt_spans=None) -> list | None:
        """A constrained step's forward (eager, or captured by SplitGraphs): the hidden states
        of its sampled rows into `slot.sample_hidden`, where they wait for the token bitmask
        (`finish_launch`); with `prompt_spans` (eager only) also their prompt logprobs."""
        hidden = self.forward_hidden(slot, shape)
        prompt_lps = self.prompt_logprobs(hidden, prompt_spans) if prompt_spans else None
        S = shape.num_samples
        if not shape.samples_every_token:
            hidden = hidden.index_select(0, slot.dev.logits_indices[:S])
        slot.sample_hidden[:S].copy_(hidden[:S])  # (in the buffer's dtype, whatever the model's)
        return prompt_lps

    def sample_deferred(self, slot: IOSlot, shape: StepShape) -> None:
        """A constrained step's sampling (eager, or captured by SplitGraphs): the logits of
        `slot.sample_hidden`, sampled under the slot's device token bitmask. (Its min_tokens
        suppression is in the bitmask: sched/structured_outputs.py.)"""
        logits = self.model.compute_logits(slot.sample_hidden[:shape.num_samples])
        self.sample(slot, shape, logits, slot.token_bitmask(self.model_config.vocab_size)[1])

    def forward(self, slot: IOSlot, shape: StepShape) -> torch.Tensor:
        """The logits of the step's sampled rows."""
        return self.logits(slot, shape, self.forward_hidden(slot, shape))

    def forward_hidden(self, slot: IOSlot, shape: StepShape) -> torch.Tensor:
        d = slot.dev
        T, B = shape.num_tokens, shape.num_seqs
        input_ids = d.input_ids[:T]
        carry_over(input_ids, d.carry_idx[:T], self.slots[1 - slot.index].dev.tokens)
        meta = AttentionMetadata(d.query_start_loc[:B + 1], d.seq_lens[:B], d.block_table[:B],
                                 d.slot_mapping[:T], shape.max_query_len, shape.max_seq_len,
                                 decode_order=d.decode_order[:B], split_counters=self.split_counters,
                                 num_decode=shape.num_decode, num_splits=shape.decode_splits,
                                 verify_len=shape.verify_len)
        return self.model(input_ids, d.positions[:T], meta, self.kv_caches)

    def replay(self, slot: IOSlot, shape: StepShape) -> None:
        """The step's CUDA graph on the current stream, its inputs uploaded to `slot`."""
        self.graphs.replay(slot.index, shape)

    def logits(self, slot: IOSlot, shape: StepShape, hidden: torch.Tensor) -> torch.Tensor:
        if not shape.samples_every_token:
            hidden = hidden.index_select(0, slot.dev.logits_indices[:shape.num_samples])
        return self.model.compute_logits(hidden)

    def prompt_logprobs(self, hidden: torch.Tensor, spans: list[PromptSpan]) -> list:
        return score_prompt_spans(self.model.compute_logits, hidden, spans)

    def sample(self, slot: IOSlot, shape: StepShape, logits: torch.Tensor,
               bitmask: torch.Tensor | None = None) -> None:
        d, S, k = slot.dev, shape.num_samples, shape.flags.num_logprobs
        tensors = SamplingTensors(token_index=d.token_index[:S], state_row=d.state_row[:S],
                                  bitmask=None if bitmask is None else bitmask[:S],
                                  **{c.name: getattr(d, c.name)[:S] for c in ALL_COLUMNS})
        out = sample(logits, tensors, shape.flags, self.penalties, out=d.tokens[:S])
        if k:
            d.logprobs[:S, :1 + k].copy_(out.logprobs)
            d.logprob_ids[:S, :k].copy_(out.logprob_ids)
        if shape.flags.use_penalties:  # only penalised requests read their counts, and every
            self.penalties.record(d.state_row[:S], out.tokens)  # batch holding one has this flag

    def fill_padding(self, slot: IOSlot, shape: StepShape) -> None:
        """Inputs of an all-padding batch of `shape`'s sizes (graph capture, profiling): a
        decode batch's rows own one token each, a mixed batch's none."""
        h, size = slot.host, shape.num_seqs
        h.query_start_loc[0] = 0
        pad_batch(h, 0, 0, 0, StepPad(shape.num_tokens, size), shape.is_decode, self.opts.max_num_seqs)
        h.decode_order[:size] = np.arange(size)
        slot.upload(size)
        self.streams.synchronize()

    # -- the pipeline -----------------------------------------------------------------
    def launch(self, batch: ScheduledBatch) -> Launched:
        if batch.spec is not None:  # drafts to verify: an eager step of its own
            if self.drafter is not None:  # (every step: runner/draft_step.py)
                return launch_device_drafting(self, batch, Launched)
            return launch_speculative(self, batch, Launched)
        slot = self.slots[batch.batch_id % 2]
        slot.h2d_done.synchronize()  # the slot's last upload is done: its host side is free
        pad = None
        if self.graphs is not None:
            pad = self.graphs.padding(batch.num_tokens, batch.num_seqs, batch.is_decode_only)
        shape = fill_inputs(batch, slot.host, self.block_size, pad, self.max_model_len)
        spans = step_prompt_spans(batch, slot.host.query_start_loc)
        return self.issue(batch, slot, shape, batch.num_seqs, batch.suppress, batch.penalty_resets,
                          spans, len(batch.sampled), defer_sampling=batch.num_constrained > 0)

    def issue(self, batch: ScheduledBatch | None, slot: IOSlot, shape: StepShape, num_rows: int,
              suppress: list, penalty_resets: list, spans: list | None, num_samples: int,
              defer_sampling: bool = False) -> Launched:
        """The device work of a step whose host inputs are in `slot` (`num_rows` real rows,
        `num_samples` real sampling rows): upload, compute, download on their streams. With
        `defer_sampling` only the upload and the forward (`forward_to_hidden`, a SplitGraphs
        graph where one fits; `suppress` is left to the bitmask): `finish_launch` queues the
        rest once the batch's token bitmask is known."""
        if shape.is_decode:
            shape = replace(shape, decode_splits=self.decode_splits(slot.host, num_rows, shape.num_seqs))
        launched = Launched(batch, slot, num_samples, shape.flags.num_logprobs)
        if defer_sampling:
            self._deferred_buffers()
        use_graph = (self.graphs is not None and not suppress and not penalty_resets and not defer_sampling
                     and not spans and self.graphs.can_replay(slot.index, shape))
        prompt_lps = None
        s = self.streams
        with s.uploading(slot):
            slot.upload(num_rows)  # (padding rows never read their block table)
        # (not `s.computing`: a deferred batch records compute_done only after its sampling)
        with s.on(s.compute):
            s.wait(s.compute, slot.h2d_done)
            s.wait(s.compute, slot.d2h_done)  # the slot's previous tokens were copied out
            slot.compute_start.record()
            if (not use_graph and self.graphs is not None and not suppress and not penalty_resets and not spans
                    and not defer_sampling):
                use_graph = self.graphs.capture_if_seen(self, slot, shape)
            if use_graph:
                self.replay(slot, shape)
                self.graph_replays["decode" if shape.is_decode else "mixed"][slot.index] += 1
            else:
                for row, prompt, outputs in penalty_resets:
                    self.penalties.reset_row(row, prompt, outputs)
                if defer_sampling:
                    prompt_lps = self._forward_deferred(launched, slot, shape, spans)
                else:
                    prompt_lps = self.compute_step(slot, shape, suppress, spans)
            launched.prompt_logprobs = prompt_lps
            if defer_sampling:
                return launched
            slot.compute_done.record()
        self._download(launched)
        return launched

    def _download(self, launched: Launched) -> None:
        slot, s = launched.slot, self.streams
        with s.on(s.d2h):
            s.wait(s.d2h, slot.compute_done)
            slot.d2h_start.record()
            slot.download(launched.num_samples, launched.num_logprobs)
            slot.d2h_done.record()

    def _forward_deferred(self, launched: Launched, slot: IOSlot, shape: StepShape,
                          spans: list | None) -> list | None:
        """A constrained step's forward on the compute stream: its graph where one fits."""
        launched.pending_shape = shape
        if not spans and self.split_graphs is not None and self.split_graphs.forward(self, slot, shape):
            return None
        return self.forward_to_hidden(slot, shape, spans)

    def _deferred_buffers(self) -> None:
        """Both slots' bitmasks and hidden-state buffers, at the first constrained step (the
        second slot's graphs are cloned from the first's: the cloner maps these too).  On the
        default stream, finished before any stream uses them."""
        if self.slots[0].sample_hidden is not None:
            return
        for slot in self.slots:
            slot.deferred_sampling_buffers(self.model_config.vocab_size, self.model_config.hidden_size, self.dtype)
        self.streams.synchronize()
        if self.graphs is not None and self.graphs.cloner is not None:
            self.graphs.cloner.remap(self.slots)

    def token_bitmask(self, launched: Launched) -> torch.Tensor:
        """The pinned host bitmask of a launched batch's slot (int32 [num_samples, ceil(V / 32)],
        padding rows included), for the scheduler to fill every row of: it holds an older
        step's rows, and clearing [256, 4748] words a step is CPU time spent for nothing where
        every row is constrained."""
        slot = launched.slot
        slot.mask_done.synchronize()  # the slot's previous bitmask copy has read it
        return slot.token_bitmask(self.model_config.vocab_size)[0][:launched.pending_shape.num_samples]

    def finish_launch(self, launched: Launched) -> None:
        """Queue a deferred batch's sampling once `token_bitmask(launched)` is filled: the
        bitmask's copy on the h2d stream, the sampling on the compute stream after it, then
        the download."""
        slot, shape, s = launched.slot, launched.pending_shape, self.streams
        host, dev = slot.token_bitmask(self.model_config.vocab_size)
        S = shape.num_samples
        with s.on(s.h2d):
            dev[:S].copy_(host[:S], non_blocking=True)
            slot.mask_done.record()
        with s.on(s.compute):
            s.wait(s.compute, slot.mask_done)
            if self.split_graphs is None or not self.split_graphs.sample(self, slot, shape):
                self.sample_deferred(slot, shape)
            slot.compute_done.record()
        launched.pending_shape = None
        self._download(launched)

    def wait(self, launched: Launched) -> BatchResult:
        if launched.needs_mask:
            raise RuntimeError("wait() on a batch whose sampling still waits for its bitmask (finish_launch)")
        slot = launched.slot
        slot.d2h_done.synchronize()
        S, k = launched.num_samples, launched.num_logprobs
        result = BatchResult(tokens=slot.host.tokens[:S].numpy().copy())
        if k:
            result.logprobs = slot.host.logprobs[:S, :1 + k].numpy().copy()
            result.logprob_ids = slot.host.logprob_ids[:S, :k].numpy().copy()
        if launched.spec_out is not None:
            result.spec_tokens = launched.spec_out[0].numpy().copy()
            result.num_emitted = launched.spec_out[1].numpy().copy()
            result.num_drafted = launched.spec_out[2].numpy().copy()
            if launched.spec_logprobs is not None:
                result.spec_logprobs = launched.spec_logprobs[0].numpy().copy()
                result.spec_logprob_ids = launched.spec_logprobs[1].numpy().copy()
        if launched.prompt_logprobs is not None:  # (its compute finished before d2h_done)
            result.prompt_logprobs = [(lp.cpu().numpy(), ids.cpu().numpy()) for lp, ids in launched.prompt_logprobs]
        if self.trace_origin is not None and self.streams.cuda:
            launched.gpu_times = self._gpu_times(slot)
        return result

    def _gpu_times(self, slot: IOSlot) -> dict[str, tuple[float, float]]:
        """Wall-clock (perf_counter) spans of the batch's three stream stages."""
        origin, t0 = self.trace_origin

        def at(ev) -> float:
            return t0 + origin.elapsed_time(ev) / 1e3

        return {"h2d": (at(slot.h2d_start), at(slot.h2d_done)),
                "compute": (at(slot.compute_start), at(slot.compute_done)),
                "d2h": (at(slot.d2h_start), at(slot.d2h_done))}
