"""Prometheus metrics of one server (vLLM's names under the ``slipstream:`` prefix).

Each app owns a `CollectorRegistry`; nothing is registered globally. Gauges and the
engine's cumulative counters (preemptions, prefix-cache queries and hits) are read from
`llm.stats()` when /metrics is scraped; token counters, finished requests and the latency
histograms are fed by `RequestTracker` as requests run.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineStatsCollector:
    """Yields the gauges and cumulative engine counters from the latest stats snapshot."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: dict = {}

    def collect(self):
        s, labels = self.stats, [self.model_name]
        for name, key, doc in (
                ("slipstream:num_requests_running", "num_running", "Requests running in the engine."),
                ("slipstream:num_requests_waiting", "num_waiting", "Requests waiting in the engine."),
                ("slipstream:kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage, 0 to 1."),
                ("slipstream:kv_blocks_in_use", "kv_blocks_in_use", "KV-cache blocks in use."),
                ("slipstream:kv_blocks_total", "kv_blocks_total", "KV-cache blocks in all.")):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, float(s.get(key) or 0))
            yield g
        for name, key, doc in (
                ("slipstream:num_preemptions", "num_preemptions", "Preemptions in the engine."),
                ("slipstream:prefix_cache_queries", "prefix_cache_queries",
                 "Prefix-cache queries, in blocks."),
                ("slipstream:prefix_cache_hits", "prefix_cache_hits", "Prefix-cache hits, in blocks.")):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, float(s.get(key) or 0))
            yield c
        # grammar compiles in the engine core (structured outputs), where the core reports them
        for name, key, doc in _GRAMMAR_COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, float(s.get(key) or 0))
            yield c
        # speculative decoding, where the engine has it on
        if "spec_num_draft_tokens" in s:
            for name, key, doc in _SPEC_COUNTERS:
                c = CounterMetricFamily(name, doc, labels=["model_name"])
                c.add_metric(labels, float(s.get(key) or 0))
                yield c
            g = GaugeMetricFamily("slipstream:spec_decode_mean_accepted_length",
                                  "Tokens a drafting row emits per step (accepted drafts + 1), since start.",
                                  labels=["model_name"])
            g.add_metric(labels, float(s.get("spec_mean_accepted_length") or 0))
            yield g
        if s.get("replicas"):
            yield from _replica_families(self.model_name, s["replicas"])


_GRAMMAR_COUNTERS = (
    ("slipstream:grammar_compile_seconds", "grammar_compile_seconds",
     "Time spent compiling output grammars (structured outputs, forced tool calls)."),
    ("slipstream:grammar_compiles", "grammar_compiled", "Output grammars compiled."),
    ("slipstream:grammar_compile_failures", "grammar_compile_failed",
     "Output grammars that did not compile."),
    ("slipstream:grammar_cache_hits", "grammar_cache_hits",
     "Requests whose grammar was found compiled in the cache."),
    ("slipstream:grammar_bitmask_seconds", "grammar_cpu_seconds",
     "Time the engine's step loop spent filling grammar token masks."))

_SPEC_COUNTERS = (
    ("slipstream:spec_decode_num_drafts", "spec_num_drafting_rows", "Row-steps that verified drafts."),
    ("slipstream:spec_decode_num_draft_tokens", "spec_num_draft_tokens", "Draft tokens verified."),
    ("slipstream:spec_decode_num_accepted_tokens", "spec_num_accepted_tokens", "Draft tokens accepted."),
    ("slipstream:spec_decode_num_emitted_tokens", "spec_num_emitted_tokens",
     "Tokens emitted by rows that verified drafts."))

# Data-parallel serving: the families above are summed over the replicas; these are per
# replica (label replica="0", ...), with the router's counts.
_REPLICA_GAUGES = (
    ("slipstream:replica_up", "up", "1 while the replica serves, 0 while it restarts."),
    ("slipstream:replica_num_requests_running", "num_running", "Requests running in the replica."),
    ("slipstream:replica_num_requests_waiting", "num_waiting", "Requests waiting in the replica."),
    ("slipstream:replica_kv_cache_usage_perc", "kv_cache_usage", "The replica's KV-cache usage, 0 to 1."),
    ("slipstream:replica_kv_blocks_total", "kv_blocks_total", "The replica's KV-cache blocks in all."),
    ("slipstream:replica_requests_outstanding", "outstanding", "Requests routed to the replica, not ended."))
_REPLICA_COUNTERS = (
    ("slipstream:replica_requests_routed", "routed", "Requests the router sent to the replica."),
    ("slipstream:replica_requests_prefix_routed", "affine",
     "Requests sent to the replica because it held their prompt prefix."),
    ("slipstream:replica_prefix_cache_hits", "prefix_cache_hits", "The replica's prefix-cache hits, in blocks."),
    ("slipstream:replica_prefix_cache_queries", "prefix_cache_queries",
     "The replica's prefix-cache queries, in blocks."),
    ("slipstream:replica_restarts", "restarts", "Times the replica was restarted after it died."))


def _replica_families(model_name: str, replicas: list[dict]):
    for kind, table in ((GaugeMetricFamily, _REPLICA_GAUGES), (CounterMetricFamily, _REPLICA_COUNTERS)):
        for name, key, doc in table:
            fam = kind(name, doc, labels=["model_name", "replica"])
            for r in replicas:
                fam.add_metric([model_name, str(r["replica"])], float(r.get(key) or 0))
            yield fam


class ServerMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.engine = _EngineStatsCollector(model_name)
        self.registry.register(self.engine)
        lab, reg = ["model_name"], self.registry
        self.prompt_tokens = Counter("slipstream:prompt_tokens", "Prompt tokens processed.",
                                     lab, registry=reg)
        self.generation_tokens = Counter("slipstream:generation_tokens", "Tokens generated.",
                                         lab, registry=reg)
        self.request_success = Counter("slipstream:request_success",
                                       "Finished completions, by finish reason.",
                                       lab + ["finished_reason"], registry=reg)
        self.ttft = Histogram("slipstream:time_to_first_token_seconds", "Time to first token.",
                              lab, buckets=_LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram("slipstream:inter_token_latency_seconds", "Time between tokens.",
                             lab, buckets=_ITL_BUCKETS, registry=reg)
        self.itl_child = self.itl.labels(model_name)  # observed per token: look it up once
        self.e2e = Histogram("slipstream:e2e_request_latency_seconds", "Request latency.",
                             lab, buckets=_LATENCY_BUCKETS, registry=reg)
        self.queue = Histogram("slipstream:request_queue_time_seconds",
                               "Time waiting in the engine before the first step.",
                               lab, buckets=_LATENCY_BUCKETS, registry=reg)
        self.constrained = Counter("slipstream:structured_output_requests",
                                   "Requests with an output constraint, by its kind (json, regex, "
                                   "choice, grammar, json_object, structural_tag).",
                                   lab + ["kind"], registry=reg)

    def count_constraint(self, constraint) -> None:
        """Count an engine request's output constraint (a StructuredOutputsParams or None)."""
        if constraint is not None:
            self.constrained.labels(self.model_name, constraint.kind).inc()

    def render(self, stats: dict | None) -> bytes:
        if stats is not None:
            self.engine.stats = dict(stats)
        return generate_latest(self.registry)

    def tracker(self, n: int = 1, prompt_tokens: int = 0) -> RequestTracker:
        return RequestTracker(self, n, prompt_tokens)


class RequestTracker:
    """Follows one engine request's outputs (deltas: each output carries its new tokens and
    the completions that ended) and records it once it ends (or is dropped: a request that
    is not streamed has no output before its end, so its counts cannot wait for one)."""

    def __init__(self, m: ServerMetrics, n: int = 1, prompt_tokens: int = 0):
        self.m = m
        self.n = n  # the request's completions
        self.prompt_tokens = prompt_tokens
        self.start = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.ntokens = 0
        self.itl_observed = False
        self.finish_reasons: dict[int, str] = {}  # completion index -> how it ended
        self.out = None
        self.done = False

    def update(self, out) -> None:
        now = time.monotonic()
        n = sum(len(c.new_token_ids) for c in out.outputs)
        if n:
            if self.first is None:
                self.first = now
            elif self.last is not None:
                gap = (now - self.last) / n
                child = self.m.itl_child
                for _ in range(n):
                    child.observe(gap)
                self.itl_observed = True
            self.last = now
            self.ntokens += n
        for c in out.outputs:
            if c.finish_reason is not None:
                self.finish_reasons[c.index] = c.finish_reason
        self.out = out

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        m, name, out = self.m, self.m.model_name, self.out
        m.prompt_tokens.labels(name).inc(self.prompt_tokens)
        m.generation_tokens.labels(name).inc(self.ntokens)
        for i in range(self.n):
            m.request_success.labels(name, self.finish_reasons.get(i, "abort")).inc()
        if out is None:  # dropped before its first output: no latency to tell
            return
        now = time.monotonic()
        met = getattr(out, "metrics", None)
        ttft = e2e = queue = None
        if met is not None:
            if met.first_token_time is not None:
                ttft = met.first_token_time - met.arrival_time
            if met.finished_time is not None:
                e2e = met.finished_time - met.arrival_time
            queue = met.queue_time_s
            self._itl_from_engine_times(met)
        if ttft is None and self.first is not None:
            ttft = self.first - self.start
        if e2e is None:
            e2e = now - self.start
        if ttft is not None and ttft >= 0:
            m.ttft.labels(name).observe(ttft)
        if e2e >= 0:
            m.e2e.labels(name).observe(e2e)
        if queue is not None and queue >= 0:
            m.queue.labels(name).observe(queue)

    def _itl_from_engine_times(self, met) -> None:
        """A request whose tokens came in one output (not streamed: FINAL_ONLY) has no gaps
        between outputs; its inter-token latency is the engine's first-to-last token time
        spread over its tokens."""
        if self.itl_observed or self.ntokens < 2:
            return
        if met.first_token_time is None or met.last_token_time is None:
            return
        gap = (met.last_token_time - met.first_token_time) / (self.ntokens - 1)
        if gap >= 0:
            child = self.m.itl_child
            for _ in range(self.ntokens - 1):
                child.observe(gap)
