"""Prometheus metrics, one CollectorRegistry per app (no global registry).

The speculative counters carry the names people already scrape (vLLM's `spec_decode_*`), with the
`specdec:` prefix; prometheus-client exports counters with a `_total` suffix, as vLLM's are:
  specdec:spec_decode_num_drafts_total                  draft rounds (at least one token proposed)
  specdec:spec_decode_num_draft_tokens_total            tokens proposed
  specdec:spec_decode_num_accepted_tokens_total         tokens accepted
  specdec:spec_decode_num_accepted_tokens_per_pos_total{position="i"}  accepted at draft position i
so acceptance rate = accepted / draft_tokens and mean acceptance length = 1 + accepted / drafts.
Per-token latency as serving benchmarks report it (vLLM's names): time per output token after the
first, per request (TPOT), and the gap between consecutive output tokens (ITL; the tokens of one
speculative round arrive together, so each gets the round's gap divided among them).
The prompt cache (engine/prompt_cache.py): starts parked and the tokens they hold, and since the
engine started, requests that restored one, the prompt tokens they did not process again, and
starts dropped for room; the same for copies in host memory, and for the draft model's copies.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from specdec.engine.prompt_cache import PromptCache

TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                         0.75, 1.0, 2.5, 5.0, 10.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
          "/infill", "/v1/models", "/health", "/metrics", "/v1/specdec/costs", "/")


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = registry = CollectorRegistry()
        labels = ["model_name", "method"]
        self.num_drafts = Counter("specdec:spec_decode_num_drafts", "Draft rounds (at least one token proposed).",
                                  labels, registry=registry)
        self.num_draft_tokens = Counter("specdec:spec_decode_num_draft_tokens", "Draft tokens proposed.",
                                        labels, registry=registry)
        self.num_accepted_tokens = Counter("specdec:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                           labels, registry=registry)
        self.accepted_per_pos = Counter("specdec:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by position in the draft (0 = first).",
                                        labels + ["position"], registry=registry)
        self.request_success = Counter("specdec:request_success", "Finished generations, by finish reason.",
                                       ["model_name", "finished_reason"], registry=registry)
        self.prompt_tokens = Counter("specdec:prompt_tokens", "Prompt tokens of finished generations.",
                                     ["model_name"], registry=registry)
        self.cached_prompt_tokens = Counter("specdec:prefix_cache_hit_tokens",
                                            "Prompt tokens reused from the prefix cache.", ["model_name"],
                                            registry=registry)
        self.generation_tokens = Counter("specdec:generation_tokens", "Tokens generated.", ["model_name"],
                                         registry=registry)
        self.ttft = Histogram("specdec:time_to_first_token_seconds", "Arrival to first generated token.",
                              ["model_name"], buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e_latency = Histogram("specdec:e2e_request_latency_seconds", "Arrival to last generated token.",
                                     ["model_name"], buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram("specdec:request_time_per_output_token_seconds",
                              "Per request: first to last generated token, over the tokens after the first.",
                              ["model_name"], buckets=TOKEN_LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("specdec:inter_token_latency_seconds", "Gap between consecutive generated tokens.",
                             ["model_name"], buckets=TOKEN_LATENCY_BUCKETS, registry=registry)
        self.http_requests = Counter("specdec:http_requests", "HTTP requests, by route and status code.",
                                     ["route", "status"], registry=registry)
        self.http_latency = Histogram("specdec:http_request_duration_seconds", "HTTP request duration.",
                                      ["route"], buckets=LATENCY_BUCKETS, registry=registry)
        self.running = Gauge("specdec:num_requests_running", "Generations holding a slot.", ["model_name"],
                             registry=registry)
        self.waiting = Gauge("specdec:num_requests_waiting", "Requests queued for a slot.", ["model_name"],
                             registry=registry)
        self.backend_stalls = Counter("specdec:backend_stalls", "Times a backend call outlasted --stall-timeout.",
                                      ["model_name"], registry=registry)
        # What the server keeps between requests, to see that memory levels off (docs/server.md, soak).
        self.history_tenants = Gauge("specdec:history_tenants", "Tenants with a cross-request history.",
                                     ["model_name"], registry=registry)
        self.history_tokens = Gauge("specdec:history_tokens", "Tokens in the cross-request histories, all tenants.",
                                    ["model_name"], registry=registry)
        self.prefix_cache_tokens = Gauge("specdec:prefix_cache_tokens", "Tokens held in the slots' target caches.",
                                         ["model_name"], registry=registry)

    def track_scheduler(self, running: Callable[[], float], waiting: Callable[[], float]) -> None:
        self.running.labels(self.model_name).set_function(running)
        self.waiting.labels(self.model_name).set_function(waiting)

    def track_caches(self, tenants: Callable[[], float], history_tokens: Callable[[], float],
                     prefix_tokens: Callable[[], float]) -> None:
        self.history_tenants.labels(self.model_name).set_function(tenants)
        self.history_tokens.labels(self.model_name).set_function(history_tokens)
        self.prefix_cache_tokens.labels(self.model_name).set_function(prefix_tokens)

    def track_prompt_cache(self, cache: Callable[[], Optional[PromptCache]],
                           draft_copies: Callable[[], Optional[PromptCache]] = lambda: None) -> None:
        """`cache`, `draft_copies`: the serving engine's prompt cache and its draft model's copies
        now (the engine changes at a build switch)."""
        self.registry.register(_PromptCacheCollector(self.model_name, cache, draft_copies))

    # -- recording (thread-safe: called from the scheduler thread) ------------------------------
    def observe_first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def observe_tokens(self, count: int, gap: float) -> None:
        """`count` tokens arrived together, `gap` seconds after the previous ones of the request."""
        per_token = gap / count
        itl = self.itl.labels(self.model_name)
        for _ in range(count):
            itl.observe(per_token)

    def observe_time_per_output_token(self, seconds: float) -> None:
        self.tpot.labels(self.model_name).observe(seconds)

    def observe_finished(self, stats: dict, finish_reason: str, seconds: float) -> None:
        model = self.model_name
        self.request_success.labels(model, finish_reason).inc()
        self.e2e_latency.labels(model).observe(seconds)
        self.prompt_tokens.labels(model).inc(stats.get("prompt_tokens", 0))
        self.cached_prompt_tokens.labels(model).inc(stats.get("cached_prompt_tokens", 0))
        self.generation_tokens.labels(model).inc(stats.get("generated_tokens", 0))
        method = stats.get("method", "off")
        self.num_drafts.labels(model, method).inc(stats.get("draft_rounds", 0))
        self.num_draft_tokens.labels(model, method).inc(stats.get("drafted_tokens", 0))
        self.num_accepted_tokens.labels(model, method).inc(stats.get("accepted_tokens", 0))
        for position, accepted in enumerate(stats.get("accepted_per_position", [])):
            self.accepted_per_pos.labels(model, method, str(position)).inc(accepted)

    def observe_stall(self) -> None:
        self.backend_stalls.labels(self.model_name).inc()

    def observe_http(self, path: str, status: int, seconds: float) -> None:
        route = path if path in ROUTES else "other"
        self.http_requests.labels(route, str(status)).inc()
        self.http_latency.labels(route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PromptCacheCollector(Collector):
    """Read at scrape time from the engine's own counts (which restart with a new engine)."""

    def __init__(self, model_name: str, cache: Callable[[], Optional[PromptCache]],
                 draft_copies: Callable[[], Optional[PromptCache]]):
        self.model_name, self.cache, self.draft_copies = model_name, cache, draft_copies

    def collect(self):
        cache, draft = self.cache(), self.draft_copies()
        stats, held = ((cache.stats, (len(cache), cache.held_tokens, cache.saved_count, cache.saved_bytes))
                       if cache is not None else (None, (0, 0, 0, 0)))
        for name, text, value in (("parked_prompts", "Prompt starts parked in the KV cache.", held[0]),
                                  ("parked_prompt_tokens", "Positions the parked prompt starts hold.", held[1]),
                                  ("prompt_cache_host_prompts", "Prompt starts copied to host memory.", held[2]),
                                  ("prompt_cache_host_bytes", "Bytes of host memory those copies hold.", held[3]),
                                  ("prompt_cache_draft_host_bytes",
                                   "Bytes of host memory the draft model's copies of conversations hold.",
                                   draft.saved_bytes if draft is not None else 0)):
            gauge = GaugeMetricFamily(f"specdec:{name}", text, labels=["model_name"])
            gauge.add_metric([self.model_name], value)
            yield gauge
        for name, text, field in (("prompt_cache_hits", "Requests that restored a parked prompt start.", "hits"),
                                  ("prompt_cache_restored_tokens", "Prompt tokens restored, not processed again.",
                                   "tokens_restored"),
                                  ("prompt_cache_evictions", "Parked prompt starts dropped for room.", "evicted"),
                                  ("prompt_cache_host_hits", "Requests that loaded a prompt start from host memory.",
                                   "host_hits"),
                                  ("prompt_cache_host_restored_tokens", "Prompt tokens loaded from host memory.",
                                   "host_tokens_restored"),
                                  ("prompt_cache_host_evictions", "Copies in host memory dropped for the bound.",
                                   "host_evicted"),
                                  ("prompt_cache_gathered", "Cached prompt starts moved into cells that lie "
                                   "together (their attention read past other conversations' cells).", "gathered"),
                                  ("prompt_cache_host_load_failures",
                                   "Copies in host memory that did not load (dropped; the prompt processed again).",
                                   "host_failed")):
            counter = CounterMetricFamily(f"specdec:{name}", text, labels=["model_name"])
            counter.add_metric([self.model_name], getattr(stats, field) if stats is not None else 0)
            yield counter
        counter = CounterMetricFamily("specdec:prompt_cache_draft_host_hits",
                                      "Requests whose draft model loaded its copy of the conversation.",
                                      labels=["model_name"])
        counter.add_metric([self.model_name], draft.stats.host_hits if draft is not None else 0)
        yield counter


class HTTPMetricsMiddleware:
    """Counts every HTTP request by route and status, and times it to its last byte (pure ASGI, so
    streaming responses pass through untouched)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.observe_http(scope.get("path", ""), status["code"], time.monotonic() - started)
