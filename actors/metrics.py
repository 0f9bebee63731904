"""Prometheus metrics under the `forge:` prefix, with the names serving dashboards already use.

One registry per daemon (not the global one), so several daemons can live in one test process.
Gauges are read from the actors' statistics() at scrape time; counters and histograms are
observed where the event happens.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from actors.metric_aliases import VllmAliases
from forge.block_allocator import MISS_REASONS

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10)
_STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class LatencyWindow:
    """Recent samples of one latency, for percentiles over the last `window_s` seconds (the
    dashboard's; Prometheus users take quantiles of the histograms instead). Bounded: a ring of
    `max_samples`, the oldest overwritten first. Adding is two array stores; a percentile read
    costs a mask and a partial sort, off the per-token path."""

    def __init__(self, window_s: float = 300.0, max_samples: int = 1 << 16) -> None:
        self.window_s = window_s
        self._at = np.full(max_samples, -np.inf)
        self._values = np.zeros(max_samples)
        self._next = 0

    def add(self, value: float, now: float | None = None) -> None:
        i = self._next % len(self._values)
        self._at[i] = time.monotonic() if now is None else now
        self._values[i] = value
        self._next += 1

    def percentiles(self, now: float | None = None) -> dict[str, float | int] | None:
        """{"count", "p50", "p90", "p99"} of the samples in the window (seconds); None when empty."""
        since = (time.monotonic() if now is None else now) - self.window_s
        values = self._values[self._at >= since]
        if not len(values):
            return None
        p50, p90, p99 = np.percentile(values, [50, 90, 99]).tolist()
        return {"count": len(values), "p50": p50, "p90": p90, "p99": p99}


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.num_requests_running = Gauge("forge:num_requests_running", "Requests in the running batch.", registry=r)
        self.num_requests_waiting = Gauge("forge:num_requests_waiting", "Requests waiting to run.", registry=r)
        self.kv_cache_usage_perc = Gauge("forge:kv_cache_usage_perc", "KV-cache usage, 1 = full.", registry=r)
        self.prompt_tokens = Counter("forge:prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("forge:generation_tokens", "Tokens generated.", registry=r)
        self.request_success = Counter("forge:request_success", "Finished requests.", ["finished_reason"],
                                       registry=r)
        self.request_aborted = Counter("forge:request_aborted", "Requests whose client left, by where they were.",
                                       ["phase"], registry=r)
        self.request_rejected = Counter("forge:request_rejected", "Requests refused, by reason.", ["reason"],
                                        registry=r)
        self.request_failed = Counter("forge:request_failed", "Requests ended by a fault of the engine.", registry=r)
        self.num_preemptions = Counter("forge:num_preemptions", "Sequences preempted.", registry=r)
        self.prefix_cache_hit_rate = Gauge("forge:prefix_cache_hit_rate", "Prompt tokens found cached.",
                                           registry=r)
        self.prefix_cache_queries = Counter("forge:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.", registry=r)
        self.prefix_cache_hits = Counter("forge:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                         registry=r)
        self.prefix_cache_misses = Counter("forge:prefix_cache_misses", "Prompt tokens not found, by reason.",
                                           ["reason"], registry=r)
        self.kv_events_published = Counter("forge:kv_events_published", "KV-event batches sent (--kv-events).",
                                           registry=r)
        self.kv_events_dropped = Counter("forge:kv_events_dropped",
                                         "KV-event batches dropped: the queue to the socket was full.", registry=r)
        self.time_to_first_token = Histogram("forge:time_to_first_token_seconds", "Time to first token.",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("forge:inter_token_latency_seconds", "Time between tokens.",
                                             buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.time_per_output_token = Histogram("forge:time_per_output_token_seconds",
                                               "A request's time per token after its first.",
                                               buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram("forge:e2e_request_latency_seconds", "Request latency.",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.request_queue_time = Histogram("forge:request_queue_time_seconds", "Time queued before running.",
                                            buckets=_LATENCY_BUCKETS, registry=r)
        # per engine step: the tokens it computed (prefill chunks plus one per decode) and how long
        # its forward and sampling took (what --max-num-batched-tokens trades against TPOT)
        self.iteration_tokens = Histogram("forge:iteration_tokens_total", "Tokens computed per engine step.",
                                          buckets=_STEP_TOKEN_BUCKETS, registry=r)
        self.step_duration = Histogram("forge:step_duration_seconds", "Forward and sampling time of a step.",
                                       buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        # speculative decoding, with vLLM's meanings
        self.spec_num_drafts = Counter("forge:spec_decode_num_drafts", "Sequence-steps that carried drafts.",
                                       registry=r)
        self.spec_num_draft_tokens = Counter("forge:spec_decode_num_draft_tokens", "Draft tokens proposed.",
                                             registry=r)
        self.spec_num_accepted_tokens = Counter("forge:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                                registry=r)
        self.spec_accepted_per_pos = Counter("forge:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by their position in the draft.",
                                             ["position"], registry=r)
        self.model_swaps = Counter("forge:model_swaps", "Models unloaded to make room for another's load.",
                                   ["model_name"], registry=r)
        self.model_loads = Counter("forge:model_loads", "Model loads, by model.", ["model_name"], registry=r)
        self.kernels = Gauge("forge:kernels_info",
                             "The kernels in use: the weights' backend, its numerics, the decode attention.",
                             ["backend", "numerics", "attention"], registry=r)
        # the dashboard's recent latencies (GET /stats), recorded beside the histograms above
        self.recent_ttft = LatencyWindow()
        self.recent_itl = LatencyWindow()
        self.recent_tpot = LatencyWindow()
        self._refreshers: list[Callable[[], None]] = []

    def serve(self, *, model_name: str, block_size: int, num_blocks: int, cache_dtype: str, prefix_caching: bool,
              num_spec_positions: int = 0) -> None:
        """Once the model is loaded: every labelled series this daemon can produce created at zero,
        so that replicas of one configuration expose the same label sets from their first scrape
        (routers that merge replicas' metrics refuse mismatched ones), and the vLLM-named aliases."""
        for reason in ("stop", "length"):
            self.request_success.labels(finished_reason=reason)
        for phase in ("queued", "prefill", "decode"):
            self.request_aborted.labels(phase=phase)
        for rejected in ("overload", "draining", "too_long", "auth", "invalid"):
            self.request_rejected.labels(reason=rejected)
        for miss in MISS_REASONS:
            self.prefix_cache_misses.labels(reason=miss)
        for pos in range(num_spec_positions):
            self.spec_accepted_per_pos.labels(position=str(pos))
        own = [m for m in vars(self).values() if isinstance(m, (Counter, Gauge, Histogram))]
        self.registry.register(VllmAliases(
            own,   # the aliases pick their families by name (metric_aliases.ALIASES)
            model_name, {"block_size": str(block_size), "num_gpu_blocks": str(num_blocks), "cache_dtype": cache_dtype,
                         "enable_prefix_caching": str(prefix_caching)}))

    def on_scrape(self, refresh: Callable[[], None]) -> None:
        self._refreshers.append(refresh)

    def refresh(self) -> None:
        """Bring the gauges read from the actors up to date (what a scrape does first)."""
        for refresh in self._refreshers:
            refresh()

    def render(self) -> bytes:
        self.refresh()
        return generate_latest(self.registry)
