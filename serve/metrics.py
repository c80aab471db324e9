"""``GET /metrics``: the server's Prometheus series (docs/serving.md, "Metrics").

One :class:`ServerMetrics` per app, on its own ``CollectorRegistry`` (no process-global state:
several apps, e.g. tests', each count their own requests). Two kinds of series:

- observed per finished request (the app calls :meth:`ServerMetrics.observe`): time to first
  token, time per output token, end-to-end latency (histograms); prompt and generation tokens,
  finished requests by finish reason (counters); where the engine reports adaptive depth (the
  one-request engine, docs/adaptive-depth.md; the batching engine over a recurrent-depth
  artifact, exits only): each generated token's exit depth, the loops it was read at
  (histogram), and the passes over the core layers (counter, prefill excluded);
- read from the engine at scrape time (:class:`_EngineCollector`): requests running and waiting,
  KV slots in use and committed KV tokens, engine steps, prefix-cache queries and hits, and
  speculation's drafted and accepted tokens (the engine's own monotonic counters, so they
  include requests still running).

Names follow vLLM's series with a ``loopcast_`` prefix (``vllm:time_to_first_token_seconds`` is
``loopcast_time_to_first_token_seconds``); counters end in ``_total`` as the exposition format wants.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Latency buckets (seconds): from a captured GPU step (~1 ms) to a long CPU generation.
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Exit depths (loops): every depth of a small loop count, then coarser for recurrent-depth models.
_DEPTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class ServerMetrics:
    """The registry of one app over one engine."""

    def __init__(self, engine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ("model_name",)
        self.ttft = Histogram(
            "loopcast_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.",
            labels,
            buckets=sorted({*_TOKEN_BUCKETS, *_REQUEST_BUCKETS}),
            registry=self.registry,
        ).labels(model_name)
        self.tpot = Histogram(
            "loopcast_time_per_output_token_seconds",
            "Mean gap between a request's generated tokens after the first.",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e = Histogram(
            "loopcast_e2e_request_latency_seconds",
            "Time from a request's arrival to its last token.",
            labels,
            buckets=_REQUEST_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.prompt_tokens = Counter(
            "loopcast_prompt_tokens", "Prompt tokens of finished requests.", labels, registry=self.registry
        ).labels(model_name)
        self.generation_tokens = Counter(
            "loopcast_generation_tokens",
            "Generated tokens of finished requests.",
            labels,
            registry=self.registry,
        ).labels(model_name)
        self._finished = Counter(
            "loopcast_request_success",
            "Finished requests by finish reason (stop, length, cancelled, error).",
            (*labels, "finished_reason"),
            registry=self.registry,
        )
        self.exit_depth = Histogram(
            "loopcast_exit_depth",
            "Loops each generated token was read at (its exit depth; static depth: the depth).",
            labels,
            buckets=_DEPTH_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.core_passes = Counter(
            "loopcast_core_passes",
            "Passes over the core layers while generating (prefill excluded).",
            labels,
            registry=self.registry,
        ).labels(model_name)
        self._model_name = model_name
        self.registry.register(_EngineCollector(engine, model_name))

    def observe(
        self,
        prompt_tokens: int,
        token_times: Sequence[float],
        arrival: float,
        end: float,
        finish_reason: str,
        depth: dict | None = None,
    ) -> None:
        """One finished request: its token times (``time.perf_counter`` values, as ``arrival``)
        and, where its engine reports them, its depth stats (``Completion.depth``)."""
        if depth:
            for loops, tokens in depth.get("exit_histogram", {}).items():
                for _ in range(tokens):  # a histogram observes one value at a time
                    self.exit_depth.observe(loops)
            self.core_passes.inc(depth.get("core_passes", 0))
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(len(token_times))
        self._finished.labels(self._model_name, finish_reason).inc()
        self.e2e.observe(max(end - arrival, 0.0))
        if token_times:
            self.ttft.observe(max(token_times[0] - arrival, 0.0))
        if len(token_times) > 1:
            self.tpot.observe((token_times[-1] - token_times[0]) / (len(token_times) - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Series read from the engine when scraped; an engine without a counter reports 0."""

    def __init__(self, engine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def collect(self) -> Iterator[Metric]:
        engine, labels = self.engine, [self.model_name]
        stats = dict(getattr(engine, "stats", None) or {})
        gen = getattr(engine, "gen", None)
        slots = gen.max_batch if gen is not None else 1
        running = getattr(engine, "running", 0)
        committed = sum(gen.lengths) if gen is not None else 0
        capacity = slots * getattr(engine, "max_length", 1)

        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> Metric:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        yield gauge("loopcast_num_requests_running", "Requests in a sequence slot.", running)
        yield gauge("loopcast_num_requests_waiting", "Requests queued for a slot.", engine.waiting)
        yield gauge("loopcast_kv_slots_total", "Sequence slots (each holds the full max length).", slots)
        yield gauge("loopcast_kv_slots_used", "Sequence slots held by running requests.", running)
        yield gauge(
            "loopcast_kv_cache_usage_ratio",
            "Committed KV positions of running requests over the KV capacity (slots x max length).",
            committed / capacity if gen is not None and capacity else 0.0,
        )
        yield counter("loopcast_engine_steps", "Engine steps (batched or one-sequence).", engine.steps)
        yield counter(
            "loopcast_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.get("prefix_query_tokens", 0),
        )
        yield counter(
            "loopcast_prefix_cache_hits",
            "Prompt tokens whose KV came from the prefix cache.",
            stats.get("prefix_hit_tokens", 0),
        )
        yield counter(
            "loopcast_spec_decode_num_draft_tokens",
            "Draft tokens verified.",
            stats.get("proposed", 0),
        )
        yield counter(
            "loopcast_spec_decode_num_accepted_tokens",
            "Draft tokens accepted.",
            stats.get("accepted", 0),
        )
        yield counter(
            "loopcast_pipeline_cycles",
            "Batched pipeline steps (cycle_batch calls over the pipeline requests' lanes).",
            stats.get("pipeline_cycles", 0),
        )
