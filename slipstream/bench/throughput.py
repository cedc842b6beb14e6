"""Offline throughput of a workload, sync vs async, with the floor and GPU active time.

Floor (docs/performance.md): for each step, bytes = weights read + KV read + KV written and
flops = 2 x matmul params x tokens + attention; the step cannot run faster than
max(bytes / copy bandwidth, flops / matmul rate).  The sum over steps is the floor of
the run; wall / floor says how far from the hardware the engine is.
"""
from __future__ import annotations

import gc
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace

import torch

from slipstream.core.messages import AddRequest
from slipstream.core.tracing import Timeline
from slipstream.bench.workloads import Workload
from slipstream.ops.kv_quant import kv_cache_torch_dtype

# The H200's, measured; `measure_ceilings` re-measures them on the GPU at hand.
COPY_BANDWIDTH = 4.26e12  # bytes/s, read + written
MATMUL_RATE = 792e12  # bf16 flop/s
# Each lent GPU's ceilings as `measure_ceilings` found them (the H100 80GB HBM3: copy 3.01 TB/s
# in every run, matmul 784-798 TFLOP/s): a run that does not measure takes its own GPU's.
RECORDED_CEILINGS = {"H200": (COPY_BANDWIDTH, MATMUL_RATE), "H100": (3.01e12, 790e12)}


def recorded_ceilings(device_name: str) -> tuple[str, float, float]:
    """(GPU, copy bandwidth, matmul rate) recorded for the GPU named `device_name` (torch's
    name, e.g. "NVIDIA H100 80GB HBM3"); the H200's for a GPU without a record."""
    gpu = next((g for g in RECORDED_CEILINGS if g in device_name), "H200")
    return (gpu, *RECORDED_CEILINGS[gpu])


@dataclass
class RunResult:
    workload: str
    mode: str
    wall_s: float
    output_tokens: int
    tokens_per_s: float
    steps: int
    gpu_active: float | None
    floor_s: float
    wall_over_floor: float
    cpu_ms_per_step: float
    gpu_ms_per_step: float | None
    breakdown: list[dict] = field(default_factory=list)  # `step_breakdown`
    gc_pauses: dict = field(default_factory=dict)  # `GcPauses.summary`
    # speculative decoding during the run (`speculation_summary`); empty when it is off
    speculation: dict = field(default_factory=dict)

    @property
    def ms_per_step(self) -> float | None:
        """Wall time per step in ms (wall / steps): a latency workload's figure."""
        return 1e3 * self.wall_s / self.steps if self.steps else None

    def row(self, ms_per_step: bool = False) -> str:
        """A table row; `ms_per_step` adds a last column, wall ms per step."""
        ga = f"{100 * self.gpu_active:.1f}%" if self.gpu_active is not None else "-"
        gpu = f"{self.gpu_ms_per_step:.2f}" if self.gpu_ms_per_step is not None else "-"
        row = (f"| {self.workload} | {self.mode} | {self.wall_s:.2f} s | {self.tokens_per_s:,.0f} | {ga} | "
               f"{self.floor_s:.2f} s | {self.wall_over_floor:.2f} | {self.cpu_ms_per_step:.2f} | {gpu} | {self.steps} |")
        if ms_per_step:
            row += f" {self.ms_per_step:.2f} |" if self.ms_per_step is not None else " - |"
        return row

    @staticmethod
    def header(ms_per_step: bool = False) -> str:
        names = ["workload", "mode", "wall", "output tok/s", "GPU active", "floor", "wall/floor", "CPU ms/step",
                 "GPU ms/step", "steps"] + (["ms per step"] if ms_per_step else [])
        return "| " + " | ".join(names) + " |\n|" + "---|" * len(names)


def measure_ceilings(device: torch.device) -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + written, bf16 matmul flop/s)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)

    def timed(fn, reps: int) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    bw = 2 * src.numel() / timed(lambda: dst.copy_(src), 20)
    rate = 2 * 8192 ** 3 / timed(lambda: a @ b, 10)
    src = dst = a = b = None  # free them (a `del` makes pyflakes flag the lambdas)
    torch.cuda.empty_cache()
    return bw, rate


@dataclass(frozen=True)
class StepCosts:
    """What one step of a model moves and computes, by part (the floor's inputs).

    A MoE model's experts count apart: a step reads the weights of the experts its tokens
    route to, not all of them. The floor takes the expected number of distinct experts a
    layer's T tokens touch under uniform, independent routing, E (1 - (1 - k/E)^T) (8 of 128
    at one row, 51.6 at 8, 125.9 at 64), since the routing itself is not recorded.

    A sliding-window layer reads only the last W keys of a query's context: its KV and
    attention count apart, through the batch's rows (`BatchStats.windowed`): min(context,
    W) keys a decode row, not its whole context."""
    weight_bytes: int  # every dense matmul weight (router included) and the LM head, read once a step
    kv_bytes_per_token: int  # K and V of one token over all layers
    matmul_params: int  # per token: 2 x this many flops (a MoE token's k experts included)
    head_params: int  # per sampled row
    attention_flops_per_pair: int  # per (query token, context position) pair
    expert_bytes: int = 0  # one expert's weights in every layer: read once a step if touched
    num_experts: int = 0
    experts_per_token: int = 0
    windows: tuple[int | None, ...] = ()  # each layer's sliding window (None: full attention)

    @classmethod
    def of(cls, c, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> "StepCosts":
        """The costs of model config `c` in `dtype`, its KV cache in `kv_dtype` (None: dtype;
        an FP8 cache reads and writes one byte an element)."""
        costs = cls._dense_or_moe(c, dtype)
        if kv_dtype is not None:
            kv_elem = torch.empty((), dtype=kv_dtype).element_size()
            costs = replace(costs, kv_bytes_per_token=2 * c.num_layers * c.num_kv_heads * c.head_dim * kv_elem)
        windows = tuple(getattr(c, "layer_windows", None) or ())
        if any(windows):
            costs = replace(costs, windows=windows)
        return costs

    @classmethod
    def _dense_or_moe(cls, c, dtype: torch.dtype) -> "StepCosts":
        elem = torch.empty((), dtype=dtype).element_size()
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        attention_params = c.hidden_size * (q + 2 * kv) + q * c.hidden_size
        head_params = c.vocab_size * c.hidden_size
        if getattr(c, "num_experts", 0):
            expert_params = 3 * c.hidden_size * c.moe_intermediate_size
            dense = c.num_layers * (attention_params + c.hidden_size * c.num_experts)  # + the router
            return cls((dense + head_params) * elem, 2 * c.num_layers * kv * elem,
                       dense + c.num_layers * c.num_experts_per_tok * expert_params, head_params,
                       4 * c.num_layers * q, c.num_layers * expert_params * elem, c.num_experts,
                       c.num_experts_per_tok)
        matmul_params = c.num_layers * (attention_params + 3 * c.hidden_size * c.intermediate_size)
        weight_bytes = (matmul_params + head_params) * elem
        if getattr(c, "quantization", None) is not None:
            weight_bytes = c.num_layers * fp8_layer_bytes(c, q, kv) + head_params * elem
        return cls(weight_bytes, 2 * c.num_layers * kv * elem, matmul_params, head_params, 4 * c.num_layers * q)

    def experts_touched(self, num_tokens: int) -> float:
        """Expected distinct experts of a layer that `num_tokens` tokens route to (class doc)."""
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1.0 - (1.0 - self.experts_per_token / self.num_experts) ** num_tokens)

    def step_weight_bytes(self, b) -> float:
        """Weights read by batch `b` (a BatchStats): all dense ones, the touched experts'."""
        return self.weight_bytes + self.expert_bytes * self.experts_touched(b.num_tokens)

    def kv_bytes(self, b) -> float:
        """KV read and written by batch `b` (a BatchStats); a windowed layer reads its window."""
        if not self.windows:
            return self.kv_bytes_per_token * (b.context_tokens + b.num_tokens)
        read, _ = self._summed_over_layers(b)
        return self.kv_bytes_per_token / len(self.windows) * (read + len(self.windows) * b.num_tokens)

    def attention_flops(self, b) -> float:
        if not self.windows:
            return self.attention_flops_per_pair * b.attention_pairs
        return self.attention_flops_per_pair / len(self.windows) * self._summed_over_layers(b)[1]

    def _summed_over_layers(self, b) -> tuple[float, float]:
        """(KV positions read, attention pairs) of batch `b` summed over the layers."""
        read = pairs = 0.0
        for window, layers in Counter(self.windows).items():
            r, p = (b.context_tokens, b.attention_pairs) if window is None else b.windowed(window)
            read, pairs = read + layers * r, pairs + layers * p
        return read, pairs

    def matmul_flops(self, b) -> int:
        return 2 * self.matmul_params * b.num_tokens + 2 * self.head_params * b.num_samples


def fp8_layer_bytes(c, q: int, kv: int) -> int:
    """Bytes a dense layer's FP8 products read: the values (one byte each), their float32
    scales and the two folded norms' float32 gammas (model/fp8_layers.py); the embedding and
    the LM head stay in the model's dtype."""
    scheme, h, i = c.quantization, c.hidden_size, c.intermediate_size
    return (scheme.weight_bytes(q + 2 * kv, h) + scheme.weight_bytes(h, q) + scheme.weight_bytes(2 * i, h)
            + scheme.weight_bytes(h, i) + 2 * 4 * h)


def step_floors(timeline: Timeline, model_config, dtype: torch.dtype,
                bandwidth: float = COPY_BANDWIDTH, rate: float = MATMUL_RATE,
                kv_dtype: torch.dtype | None = None) -> list[float]:
    """The floor of each batch of `timeline.batches`, in seconds (the KV cache's bytes in
    `kv_dtype`, None: the model's dtype)."""
    costs = StepCosts.of(model_config, dtype, kv_dtype)
    floors = []
    for b in timeline.batches:
        bytes_moved = costs.step_weight_bytes(b) + costs.kv_bytes(b)
        flops = costs.matmul_flops(b) + costs.attention_flops(b)
        floors.append(max(bytes_moved / bandwidth, flops / rate))
    return floors


STEP_BUCKETS = ((1, 16), (17, 64), (65, 128), (129, 256), (257, 1 << 30))


def step_group(b) -> str:
    """The group of batch `b` in breakdowns: "with prefill", or decode by batch size, or a
    speculative decoding step without a prompt chunk ("verify") by batch size."""
    verify = getattr(b, "verify", False)
    if b.num_tokens > b.num_samples and not verify:
        return "with prefill"
    lo, hi = next(r for r in STEP_BUCKETS if r[0] <= b.num_samples <= r[1])
    kind = "verify" if verify else "decode"
    return f"{kind} {lo}-{hi}" if hi < 1 << 30 else f"{kind} >={lo}"


def step_breakdown(timeline: Timeline, floors: list[float]) -> list[dict]:
    """GPU compute time against the floor, summed over groups of steps: batches with a
    prefill chunk, and decode-only batches by size; `idle_s` is the time the compute stream
    waited before the group's steps began, `cpu_s` the CPU's own work on the group's batches
    (schedule, launch, process; not the waits).  Says where wall - floor goes."""
    compute = {s.batch_id: (s.start, s.end) for s in timeline.spans if s.lane == "compute"}
    cpu: dict[int, float] = {}
    for s in timeline.spans:
        if s.lane == "cpu" and s.name != "wait":
            cpu[s.batch_id] = cpu.get(s.batch_id, 0.0) + s.end - s.start
    groups: dict[str, list[float]] = {}
    prev_end = None
    for b, floor in sorted(zip(timeline.batches, floors), key=lambda bf: compute.get(bf[0].batch_id, (0, 0))):
        label = step_group(b)
        start, end = compute.get(b.batch_id, (None, None))
        g = groups.setdefault(label, [0, 0.0, 0.0, 0.0, 0.0])
        g[0] += 1
        g[2] += floor
        g[4] += cpu.get(b.batch_id, 0.0)
        if start is not None:
            g[1] += end - start
            if prev_end is not None:
                g[3] += max(0.0, start - prev_end)
            prev_end = end if prev_end is None else max(prev_end, end)
    return [dict(group=k, steps=v[0], gpu_s=v[1], floor_s=v[2], idle_s=v[3], cpu_s=v[4],
                 gpu_over_floor=v[1] / v[2] if v[2] else None) for k, v in groups.items()]


def breakdown_table(rows: list[dict]) -> str:
    lines = ["| steps | count | GPU compute | floor | GPU / floor | excess | GPU idle before | CPU work |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['gpu_over_floor']:.2f}" if r["gpu_over_floor"] else "-"
        lines.append(f"| {r['group']} | {r['steps']} | {r['gpu_s']:.3f} s | {r['floor_s']:.3f} s | {ratio} | "
                     f"{r['gpu_s'] - r['floor_s']:.3f} s | {r['idle_s']:.3f} s | {r.get('cpu_s', 0.0):.3f} s |")
    return "\n".join(lines)


class GcPauses:
    """Python's garbage-collector pauses while active: count, total and longest, per
    generation (a full collection stops the CPU that feeds the GPU)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._start))

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        out = {}
        for gen in sorted({g for g, _ in self.pauses}):
            times = [t for g, t in self.pauses if g == gen]
            out[f"gen{gen}"] = {"count": len(times), "total_ms": 1e3 * sum(times), "max_ms": 1e3 * max(times)}
        return out


def add_prompt(engine, request_id: str, prompt_token_ids, params) -> None:
    """Queue token ids with their SamplingParams on an `EngineCore` of this process."""
    engine.add(AddRequest(request_id, list(prompt_token_ids), params.to_dict(), params.seed))


def run_until_done(engine) -> dict[str, list[int]]:
    """Step an `EngineCore` until every request ended; each request's output token ids.
    A request that failed (a grammar backend that cannot start, ...) fails the run, naming
    the first one's error: a benchmark of requests that did not run measures nothing."""
    tokens: dict[str, list[int]] = {}
    failed: list[tuple[str, str]] = []
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason == "error":
                failed.append((out.request_id, out.error or "no reason given"))
    if failed:
        request_id, error = failed[0]
        raise ValueError(f"{len(failed)} requests failed; the first, {request_id!r}: {error}")
    return tokens


def run_workload(engine, workload: Workload, mode: str, bandwidth: float = COPY_BANDWIDTH,
                 rate: float = MATMUL_RATE) -> tuple[RunResult, Timeline, list]:
    """Run every request of `workload` to completion in `mode` ("sync" or "async") on an
    `EngineCore`; returns the result, the timeline and each request's output token ids."""
    engine.set_async_scheduling(mode == "async")
    engine.reset_prefix_cache()
    timeline = Timeline()
    engine.loop.timeline = timeline
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    spec_before = engine.stats()
    with GcPauses() as gc_pauses:
        start = time.perf_counter()
        for i, (prompt, params) in enumerate(zip(workload.prompts, workload.params)):
            add_prompt(engine, str(i), prompt, params)
        done = run_until_done(engine)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    engine.loop.timeline = None
    outputs = [done[str(i)] for i in range(len(workload.prompts))]  # token ids, in request order
    tokens = sum(len(o) for o in outputs)
    steps = len(timeline.batches)
    cpu = sum(s.end - s.start for s in timeline.spans if s.lane == "cpu" and s.name != "wait")
    compute = [s for s in timeline.spans if s.lane == "compute"]
    floors = step_floors(timeline, engine.model_config, engine.dtype, bandwidth, rate,
                         kv_cache_torch_dtype(engine.config.kv_cache_dtype, engine.dtype))
    floor = sum(floors)
    result = RunResult(
        workload=workload.name, mode=mode, wall_s=wall, output_tokens=tokens, tokens_per_s=tokens / wall,
        steps=steps, gpu_active=timeline.busy("compute", start, start + wall) / wall if compute else None,
        floor_s=floor, wall_over_floor=wall / floor if floor else float("nan"),
        cpu_ms_per_step=1e3 * cpu / max(steps, 1),
        gpu_ms_per_step=1e3 * sum(s.end - s.start for s in compute) / steps if compute else None,
        breakdown=step_breakdown(timeline, floors) if compute else [], gc_pauses=gc_pauses.summary(),
        speculation=speculation_summary(spec_before, engine.stats(), steps))
    return result, timeline, outputs


def speculation_summary(before: dict, after: dict, steps: int) -> dict:
    """Speculative decoding between two engine stats snapshots: the drafts verified and
    accepted, and the tokens a drafting row emitted per step (its mean accepted length);
    empty when speculation is off."""
    if "spec_num_draft_tokens" not in after:
        return {}
    d = {k: after[k] - before.get(k, 0) for k in ("spec_num_steps", "spec_num_drafting_rows",
                                                  "spec_num_draft_tokens", "spec_num_accepted_tokens",
                                                  "spec_num_emitted_tokens")}
    rows = d["spec_num_drafting_rows"]
    return dict(steps_with_drafts=d["spec_num_steps"], steps=steps, drafted=d["spec_num_draft_tokens"],
                accepted=d["spec_num_accepted_tokens"],
                acceptance_rate=d["spec_num_accepted_tokens"] / d["spec_num_draft_tokens"]
                if d["spec_num_draft_tokens"] else 0.0,
                mean_accepted_length=d["spec_num_emitted_tokens"] / rows if rows else 0.0)


def result_dict(result: RunResult) -> dict:
    """The fields of `result`, and `ms_per_step` (wall ms per step)."""
    return dict(asdict(result), ms_per_step=result.ms_per_step)
