#!/usr/bin/env python
"""The peer: Hugging Face transformers' continuous batching on slipstream's seed-8b-short or moe-30b-a3b.

    python benchmarks/peer_transformers.py --out DIR [--modes async,sync] [--workload seed-8b-short]
    python benchmarks/peer_transformers.py --out DIR --workload moe-30b-a3b   (Qwen3-30B-A3B shape)

Run it through benchmarks/peer_transformers.sh, which installs flash-attn-4 (.fa4a/.fa4b) and
puts it on PYTHONPATH.  The Llama-3.1-8B shape is built from slipstream's config.json with
random bf16 weights directly on the GPU; the requests are exactly the workload's (prompt token
ids, max_tokens, greedy, EOS off).  Attention is `paged|flash_attention_4`, or `paged|sdpa`
(with a printed note) when flash-attn-4 cannot be used.

flash-attn-4 adapter: transformers 5.17 does `from flash_attn.cute import flash_attn_varlen_func`
lazily (modeling_flash_attention_utils._lazy_imports, cached in its `_flash_varlen_fn`) and
integrations/flash_paged.py calls it as `f(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=,
causal=True, window_size=(-1, -1))`, while flash-attn-4 has `qv` fourth and wants None for an
unbounded window.  We replace `flash_attn.cute.flash_attn_varlen_func` by an adapter before the
model is built (and fix transformers' cached copy if it was loaded earlier); its call count
proves it ran.

Per mode (`async` / `sync` = ContinuousBatchingConfig.use_async_batching True / False), with
CUDA graphs on: a warm-up (persistent manager: graph capture + kernel compilation, then a few
tokens on 32 prompts at a few lengths so the decode graphs of the timed run already exist), then
one timed `generate_batch` of the whole workload on the same manager, with NVML utilisation
sampled every 100 ms.  Prints a table and writes OUT/peer_transformers.json (after each mode).
--smoke runs the same flow on the CPU with a tiny model (paged|sdpa, sync): a check of the script.

MoE (`--workload moe-30b-a3b`): the model class comes from the workload's config.json
(Qwen3MoeForCausalLM), built with `experts_implementation="grouped_mm"` (transformers' grouped
GEMM over the experts; continuous batching keeps it for decode too) and random bf16 weights made
on the GPU. Its continuous batching runs without CUDA graphs by default (the grouped_mm experts do
not run under them; `--cuda-graph on` tries), with room for all 256 requests at once.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import gc
import importlib.metadata
import json
import os
import random
import sys
import threading
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slipstream.bench.workloads import get_workload  # noqa: E402

FA4 = "paged|flash_attention_4"
SDPA = "paged|sdpa"
# transformers' positional order (flash-attn 2's signature) after (q, k, v)
_POSITIONAL = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale", "causal")


def make_fa4_adapter(fa4_varlen):
    """Wrap flash-attn-4's varlen function for transformers' flash-attn-2-style positional calls."""

    @functools.wraps(fa4_varlen)
    def adapter(q, k, v, *args, **kwargs):
        if len(args) > len(_POSITIONAL):
            raise TypeError(f"flash_attn_varlen_func adapter: {len(args) + 3} positional arguments")
        for name, value in zip(_POSITIONAL, args):
            if name in kwargs:
                raise TypeError(f"flash_attn_varlen_func adapter: {name} given twice")
            kwargs[name] = value
        if kwargs.pop("dropout_p", 0.0):
            raise ValueError("flash-attn-4 has no dropout")
        if kwargs.get("window_size") is not None:  # flash-attn 2 says -1 for "unbounded", flash-attn-4 None
            kwargs["window_size"] = tuple(None if w is None or w < 0 else w for w in kwargs["window_size"])
        if "s_aux" in kwargs:  # attention sinks, as flash-attn-4 names them
            kwargs["learnable_sink"] = kwargs.pop("s_aux")
        adapter.calls += 1
        return fa4_varlen(q, k, v, **kwargs)

    adapter.calls = 0
    adapter.is_slipstream_adapter = True
    return adapter


def _einops_missing(*args, **kwargs):
    raise ImportError("einops is not installed")


def _import_fa4(notes):
    try:
        import flash_attn.cute as fa4
        return fa4
    except ModuleNotFoundError as e:
        if e.name != "einops":
            raise
    # flash_attn.cute.testing imports einops at the top, for its reference helpers only: stub it
    stub = types.ModuleType("einops")
    stub.rearrange = stub.repeat = _einops_missing
    sys.modules["einops"] = stub
    notes.append("einops is not installed: stubbed (flash-attn-4 imports it only for test helpers)")
    print(notes[-1], flush=True)
    import flash_attn.cute as fa4
    return fa4


def setup_attention(requested: str):
    """Return (attn_implementation, adapter or None, notes)."""
    notes = []
    if requested != FA4:
        return requested, None, notes
    try:
        fa4 = _import_fa4(notes)
        from transformers.utils import is_flash_attn_4_available
        if not is_flash_attn_4_available():  # transformers looks for the flash-attn-4 distribution + CUDA
            raise ImportError("transformers.utils.is_flash_attn_4_available() is False")
    except Exception as e:  # noqa: BLE001 - any failure means: no flash-attn-4 here
        note = f"NOTE: flash-attn-4 not usable ({type(e).__name__}: {e}); falling back to {SDPA}"
        print(note, flush=True)
        return SDPA, None, notes + [note]
    adapter = fa4.flash_attn_varlen_func
    if not getattr(adapter, "is_slipstream_adapter", False):
        adapter = make_fa4_adapter(adapter)
        fa4.flash_attn_varlen_func = adapter
    notes.append("adapter installed as flash_attn.cute.flash_attn_varlen_func")
    print(notes[-1], flush=True)
    return FA4, adapter, notes


def check_adapter_loaded(adapter, notes):
    """After the model is built: make sure transformers' cached varlen function is the adapter."""
    import transformers.modeling_flash_attention_utils as mfu
    cached = getattr(mfu, "_flash_varlen_fn", "missing")
    if cached is adapter:
        note = "transformers loaded the adapter (modeling_flash_attention_utils._flash_varlen_fn)"
    elif cached == "missing":
        note = "WARNING: transformers has no modeling_flash_attention_utils._flash_varlen_fn; relying on the module patch"
    else:
        mfu._flash_varlen_fn = adapter
        note = f"transformers had cached {cached!r}; replaced it by the adapter"
    notes.append(note)
    print(note, flush=True)


_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=1024)
_TINY_MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)


def build_model(config_path: str, attn: str, device: str, tiny: bool = False):
    """The workload's architecture (config.json `architectures`) with random bf16 weights made
    on `device`; a MoE model with its experts in grouped_mm."""
    import transformers
    with open(config_path) as f:
        arch = json.load(f)["architectures"][0]
    model_cls = getattr(transformers, arch)
    config = model_cls.config_class.from_json_file(config_path)
    moe = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if tiny:
        config.update({**_TINY, **(_TINY_MOE if moe else {})})
    config.eos_token_id = None  # EOS is ignored: no request may stop early
    kwargs = dict(dtype=torch.bfloat16, attn_implementation=attn)
    if moe:
        kwargs["experts_implementation"] = "grouped_mm"
    t = time.perf_counter()
    with torch.device(device):
        model = model_cls._from_config(config, **kwargs)
    with torch.no_grad():  # our own quick init, on the device: N(0, 0.02), norms 1
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.eval()
    if device == "cuda":
        torch.cuda.synchronize()
    n = sum(p.numel() for p in model.parameters())
    experts = getattr(model.config, "_experts_implementation", None) if moe else None
    if moe and experts != "grouped_mm":
        raise SystemExit(f"the experts run as {experts!r}, not grouped_mm")
    print(f"model: {arch}, {n / 1e9:.2f} B params, {model.dtype}, {model.device}, attn "
          f"{model.config._attn_implementation}" + (f", experts {experts}" if moe else "") +
          f", built in {time.perf_counter() - t:.1f} s", flush=True)
    return model


def workload_defaults(wl, prompts, new_tokens) -> dict:
    """Continuous-batching sizes of a workload: every request at once, KV for all of them."""
    if wl.name.startswith("moe-"):
        tokens = len(prompts) * (len(prompts[0]) + new_tokens)
        # 2048 tokens a step: the library sizes its activations (the logits of every token
        # included) for max_batch_tokens, and at 8192 its footprint check found 22.7 GB for the
        # 21.0 GB left beside the 61 GB of weights on an H100
        return dict(max_batch_tokens=2048, num_blocks=-(-tokens // 256) + 8, max_requests=len(prompts),
                    warmup_lens="256", cuda_graph="off")
    return dict(max_batch_tokens=8192, num_blocks=256, max_requests=32, warmup_lens="256,800,1200",
                cuda_graph="on")


class NvmlSampler:
    """Mean GPU utilisation (nvmlDeviceGetUtilizationRates().gpu) sampled every `period` s in a thread."""

    def __init__(self, period: float = 0.1):
        self.period, self.samples, self.handle = period, [], None
        try:
            import pynvml
            pynvml.nvmlInit()
            try:
                uuid = str(torch.cuda.get_device_properties(0).uuid)
                self.handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            except Exception:  # noqa: BLE001
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._util = pynvml.nvmlDeviceGetUtilizationRates
        except Exception as e:  # noqa: BLE001
            print(f"NVML unavailable: {e}", flush=True)

    def _loop(self):
        while not self._stop.wait(self.period):
            self.samples.append(self._util(self.handle).gpu)

    def __enter__(self):
        self.samples = []
        if self.handle is not None:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.handle is not None:
            self._stop.set()
            self._thread.join()

    @property
    def mean(self):
        return sum(self.samples) / len(self.samples) if self.samples else None


def cb_config(mode: str, args, on_gpu: bool):
    from transformers import ContinuousBatchingConfig
    return ContinuousBatchingConfig(
        use_async_batching=(mode == "async"),  # the option async/sync switches
        use_cuda_graph=on_gpu and args.cuda_graph == "on",  # both paths (varlen, decode); captured by warmup=True
        max_batch_tokens=args.max_batch_tokens,  # 8192 = the 32 prompts' 256 tokens in one prefill step
        num_blocks=args.num_blocks,  # x block_size 256 tokens of KV cache; 32 x 1280 needs 160
        max_requests_per_batch=args.max_requests,  # all 32 requests in every step (also fixes the warm-up's sizing)
        allow_block_sharing=False,  # random prompts share no prefix
        kv_padding_interval_size=args.kv_padding,  # 0: the library's preset (64 blocks = 16384 tokens)
    )


def generate(model, prompts, new_tokens, gen_config, cbc, persistent):
    return model.generate_batch(prompts, generation_config=gen_config, continuous_batching_config=cbc,
                                max_new_tokens=new_tokens, warmup=True, persistent_manager=persistent)


def run_mode(model, mode, prompts, new_tokens, args, on_gpu, adapter):
    from transformers import GenerationConfig
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=-1)  # greedy, EOS off
    cbc = cb_config(mode, args, on_gpu)
    # warm-up on a persistent manager: CUDA-graph capture, kernel compilation, and short runs of 32
    # prompts at a few lengths so the (q, kv) graph buckets of the timed run are captured here
    t = time.perf_counter()
    rng = random.Random(1)
    for n in args.warmup_lens:
        warm = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for _ in range(len(prompts))]
        generate(model, warm, args.warmup_tokens, gen_config, cbc, persistent=True)
    warm_s = time.perf_counter() - t
    print(f"[{mode}] warm-up {warm_s:.1f} s; adapter calls so far: {adapter.calls if adapter else '-'}", flush=True)
    if adapter is not None and adapter.calls == 0:
        print("WARNING: the flash-attn-4 adapter was never called: transformers used another function", flush=True)

    sampler = NvmlSampler()
    if on_gpu:
        torch.cuda.synchronize()
    with sampler:
        t = time.perf_counter()
        out = generate(model, prompts, new_tokens, gen_config, cbc, persistent=False)
        if on_gpu:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    model.destroy_cached_continuous_batching_manager()
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()

    lens = [len(r.generated_tokens) for r in out.values()]
    errors = [r.error for r in out.values() if r.error is not None]
    tokens = sum(lens)
    res = dict(mode=mode, wall_s=round(wall, 3), output_tokens=tokens, expected_tokens=len(prompts) * new_tokens,
               requests_returned=len(out), min_len=min(lens, default=0), max_len=max(lens, default=0),
               errors=errors[:3], tok_s=round(tokens / wall, 1),
               nvml_util_mean=None if sampler.mean is None else round(sampler.mean, 1),
               nvml_samples=len(sampler.samples), warmup_s=round(warm_s, 1),
               adapter_calls=adapter.calls if adapter else None)
    ok = len(out) == len(prompts) and not errors and min(lens, default=0) == max(lens, default=-1) == new_tokens
    res["full_length"] = ok
    print(f"[{mode}] {len(out)} requests, generated tokens {tokens} (per request {res['min_len']}..{res['max_len']}, "
          f"expected {new_tokens}): {'OK' if ok else 'MISMATCH'}" + (f"; errors: {errors[:3]}" if errors else ""),
          flush=True)
    return res


def versions():
    v = {"python": sys.version.split()[0], "torch": torch.__version__}
    for name, dist in (("transformers", "transformers"), ("flash_attn_4", "flash-attn-4"),
                       ("nvidia_cutlass_dsl", "nvidia-cutlass-dsl")):
        try:
            v[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            v[name] = None
    v["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return v


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--modes", default="async", help="comma-separated: async, sync")
    ap.add_argument("--workload", default="seed-8b-short")
    ap.add_argument("--attn", default=FA4, choices=[FA4, SDPA])
    # None: the workload's (workload_defaults)
    ap.add_argument("--max-batch-tokens", type=int, default=None)
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--max-requests", type=int, default=None)
    ap.add_argument("--cuda-graph", choices=["on", "off"], default=None,
                    help="CUDA graphs in continuous batching (default: on, off for MoE workloads)")
    ap.add_argument("--kv-padding", type=int, default=0, help="CUDA-graph KV bucket in tokens (0: library preset)")
    ap.add_argument("--warmup-lens", default=None, help="prompt lengths of the warm-up runs ('' for one "
                    "minimal run; default 256,800,1200, or 256 for MoE workloads)")
    ap.add_argument("--warmup-tokens", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, paged|sdpa, sync")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("async", "sync") for m in modes):
        ap.error(f"--modes must list async and/or sync, got {args.modes!r}")
    wl = get_workload(args.workload)
    prompts = [list(p) for p in wl.prompts]
    new_tokens = wl.params[0].max_tokens
    for key, value in workload_defaults(wl, prompts, new_tokens).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.warmup_lens = [int(x) for x in args.warmup_lens.split(",") if x.strip()] or [16]
    assert all(p.max_tokens == new_tokens and p.temperature == 0.0 and p.ignore_eos for p in wl.params), \
        "the peer runs greedy, EOS-ignored workloads with one max_tokens"
    on_gpu = not args.smoke
    if args.smoke:
        prompts, new_tokens, modes = [p[:24] for p in prompts[:4]], 8, ["sync"]
        prompts = [[t % 1000 for t in p] for p in prompts]
        args.attn, args.warmup_lens, args.warmup_tokens = SDPA, [16], 2
        args.max_batch_tokens, args.num_blocks, args.max_requests = 128, 4, len(prompts)
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device (use --smoke for a CPU check of the script)")
    print(f"workload {wl.name}: {len(prompts)} prompts x {len(prompts[0])} tokens, {new_tokens} new tokens each, "
          f"greedy, EOS ignored", flush=True)

    import transformers
    transformers.logging.set_verbosity_warning()
    attn, adapter, notes = setup_attention(args.attn)
    model = build_model(os.path.join(wl.model, "config.json"), attn, "cuda" if on_gpu else "cpu", tiny=args.smoke)
    if adapter is not None:
        check_adapter_loaded(adapter, notes)

    os.makedirs(args.out, exist_ok=True)
    report = dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), workload=wl.name,
                  num_requests=len(prompts), prompt_len=len(prompts[0]), new_tokens=new_tokens,
                  attn_implementation=attn, versions=versions(), notes=notes,
                  model_class=type(model).__name__,
                  experts_implementation=getattr(model.config, "_experts_implementation", None),
                  cb_config=dict(max_batch_tokens=args.max_batch_tokens, num_blocks=args.num_blocks, block_size=256,
                                 max_requests_per_batch=args.max_requests,
                                 use_cuda_graph=on_gpu and args.cuda_graph == "on",
                                 allow_block_sharing=False, kv_padding_interval_size=args.kv_padding or 16384,
                                 warmup_lens=args.warmup_lens, warmup_tokens=args.warmup_tokens),
                  runs=[])
    for mode in modes:
        report["runs"].append(run_mode(model, mode, prompts, new_tokens, args, on_gpu, adapter))
        with open(os.path.join(args.out, "peer_transformers.json"), "w") as f:
            json.dump(report, f, indent=2)

    print(f"\n{'attention':<25} {'mode':<6} {'wall s':>8} {'out tokens':>10} {'tok/s':>8} {'NVML util':>9}")
    for r in report["runs"]:
        util = "-" if r["nvml_util_mean"] is None else f"{r['nvml_util_mean']:.0f}%"
        print(f"{attn:<25} {r['mode']:<6} {r['wall_s']:>8.2f} {r['output_tokens']:>10} {r['tok_s']:>8.0f} {util:>9}"
              + ("" if r["full_length"] else "  (not full length!)"))
    print(f"versions: {report['versions']}")
    print(f"wrote {os.path.join(args.out, 'peer_transformers.json')}")


if __name__ == "__main__":
    main()
