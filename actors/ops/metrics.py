"""Prometheus metrics under the `forge:` prefix, with the names serving dashboards already use.

One registry per daemon (not the global one), so several daemons can live in one test process. Every
family a model's actors observe carries a `model_name` label (the served name), as vLLM's do: one scrape of
a daemon serving several models tells them apart, and replicas' series aggregate by model.
Gauges are read from the actors' statistics() at scrape time; counters and histograms are
observed where the event happens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from actors.ops.metric_aliases import VllmAliases
from forge.engine.block_allocator import MISS_REASONS

if TYPE_CHECKING:
    from actors.runtime.kv_publisher import KvEventPublisherStats
    from forge.engine.core import CoreStats
    from forge.engine.disk_tier import DiskTierStats
    from forge.messages import CacheStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10)
_DISK_READ_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
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


class Labelled:
    """One model's share of a family with labels beyond `model_name`: `.labels(reason=...)` gives that
    model's series with those labels."""

    def __init__(self, family: Any, model_name: str) -> None:
        self._family = family
        self._model_name = model_name

    def labels(self, **labels: str) -> Any:
        return self._family.labels(model_name=self._model_name, **labels)


class Metrics:
    """The daemon's registry; `model(name)` gives one model's actors their share (ModelMetrics). What the
    gateway counts before a request reaches a model (rejections) and the model set's own counters (loads,
    swaps) are the daemon's."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        per_model = ["model_name"]

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, [*per_model, *labels], registry=r)

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(name, doc, [*per_model, *labels], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, per_model, buckets=buckets, registry=r)

        self.num_requests_running = gauge("forge:num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("forge:num_requests_waiting", "Requests waiting to run.")
        self.kv_cache_usage_perc = gauge("forge:kv_cache_usage_perc", "KV-cache usage, 1 = full.")
        self.prompt_tokens = counter("forge:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("forge:generation_tokens", "Tokens generated.")
        self.request_success = counter("forge:request_success", "Finished requests.", "finished_reason")
        self.request_aborted = counter("forge:request_aborted", "Requests whose client left, by where they were.",
                                       "phase")
        self.request_failed = counter("forge:request_failed", "Requests ended by a fault of the engine.")
        self.slow_reader_aborts = counter("forge:slow_reader_aborts",
                                          "Responses ended because their client stopped reading them "
                                          "(--max-unsent-tokens).")
        self.num_preemptions = counter("forge:num_preemptions", "Sequences preempted.")
        self.fair_preemptions = counter("forge:fair_preemptions",
                                        "Sequences preempted to give a tenant under its share a slot.")
        self.prefix_cache_hit_rate = gauge("forge:prefix_cache_hit_rate", "Prompt tokens found cached.")
        self.prefix_cache_queries = counter("forge:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("forge:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prefix_cache_misses = counter("forge:prefix_cache_misses", "Prompt tokens not found, by reason.",
                                           "reason")
        self.kv_events_published = counter("forge:kv_events_published", "KV-event batches sent (--kv-events).")
        self.kv_events_dropped = counter("forge:kv_events_dropped",
                                         "KV-event batches dropped: the queue to the socket was full.")
        # the K/V disk tier (--kv-cache-dir): blocks and bytes, each file one block
        self.kv_disk_hits = counter("forge:kv_disk_hit_blocks", "Prompt blocks loaded from the disk tier.")
        self.kv_disk_misses = counter("forge:kv_disk_miss_blocks",
                                      "Full prompt blocks found neither in RAM nor on disk.")
        self.kv_disk_bad_files = counter("forge:kv_disk_bad_files", "Block files that failed their checks (misses).")
        self.kv_disk_bytes_read = counter("forge:kv_disk_read_bytes", "Bytes of K/V read from the disk tier.")
        self.kv_disk_bytes_written = counter("forge:kv_disk_written_bytes", "Bytes written to the disk tier.")
        self.kv_disk_blocks_written = counter("forge:kv_disk_written_blocks", "Blocks written to the disk tier.")
        self.kv_disk_writes_dropped = counter("forge:kv_disk_dropped_writes",
                                              "Evicted blocks not written: the writer was behind.")
        self.kv_disk_blocks = gauge("forge:kv_disk_blocks", "Block files in the disk tier.")
        self.kv_disk_bytes = gauge("forge:kv_disk_bytes", "Bytes of block files in the disk tier.")
        self.kv_disk_read_seconds = histogram("forge:kv_disk_read_seconds", "Time to load one prompt's blocks.",
                                              _DISK_READ_BUCKETS)
        self.time_to_first_token = histogram("forge:time_to_first_token_seconds", "Time to first token.",
                                             _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("forge:inter_token_latency_seconds", "Time between tokens.",
                                             _TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = histogram("forge:time_per_output_token_seconds",
                                               "A request's time per token after its first.", _TOKEN_LATENCY_BUCKETS)
        self.e2e_request_latency = histogram("forge:e2e_request_latency_seconds", "Request latency.",
                                             _LATENCY_BUCKETS)
        self.request_queue_time = histogram("forge:request_queue_time_seconds", "Time queued before running.",
                                            _LATENCY_BUCKETS)
        # per engine step: the tokens it computed (prefill chunks plus one per decode) and how long
        # its forward and sampling took (what --max-num-batched-tokens trades against TPOT)
        self.iteration_tokens = histogram("forge:iteration_tokens_total", "Tokens computed per engine step.",
                                          _STEP_TOKEN_BUCKETS)
        self.step_duration = histogram("forge:step_duration_seconds", "Forward and sampling time of a step.",
                                       _TOKEN_LATENCY_BUCKETS)
        # speculative decoding, with vLLM's meanings
        self.spec_num_drafts = counter("forge:spec_decode_num_drafts", "Sequence-steps that carried drafts.")
        self.spec_num_draft_tokens = counter("forge:spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_num_accepted_tokens = counter("forge:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = counter("forge:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by their position in the draft.", "position")
        self.kernels = gauge("forge:kernels_info",
                             "The kernels in use: the weights' backend, its numerics, the decode attention.",
                             "backend", "numerics", "attention")
        # the daemon's own
        self.request_rejected = Counter("forge:request_rejected", "Requests refused, by reason.", ["reason"],
                                        registry=r)
        self.model_swaps = Counter("forge:model_swaps", "Models unloaded to make room for another's load.",
                                   ["model_name"], registry=r)
        self.model_loads = Counter("forge:model_loads", "Model loads, by model.", ["model_name"], registry=r)
        # tenants (--api-keys-file, actors/http/tenant_limits.py): label values are the file's tenant names
        self.tenant_requests = Counter("forge:tenant_requests", "Responses let in, by tenant.", ["tenant"],
                                       registry=r)
        self.tenant_tokens = Counter("forge:tenant_tokens", "Tokens used by ended responses, by tenant and kind "
                                     "(prompt, completion).", ["tenant", "kind"], registry=r)
        self.tenant_rejected = Counter("forge:tenant_rejected", "Responses refused with 429, by tenant and the "
                                       "limit (max_concurrent, tokens_per_minute).", ["tenant", "reason"], registry=r)
        for rejected in ("overload", "draining", "too_long", "auth", "cross_site", "tenant_limit", "invalid"):
            self.request_rejected.labels(reason=rejected)
        # the vLLM-named aliases (they pick their families by name), and each served model's cache layout
        self.cache_configs: dict[str, dict[str, str]] = {}
        own = [m for m in vars(self).values() if isinstance(m, (Counter, Gauge, Histogram))]
        r.register(VllmAliases(own, self.cache_configs))
        # the dashboard's recent latencies (GET /stats), recorded beside the histograms above
        self.recent_ttft = LatencyWindow()
        self.recent_itl = LatencyWindow()
        self.recent_tpot = LatencyWindow()
        self._refreshers: list[Callable[[], None]] = []

    def model(self, model_name: str, *, num_spec_positions: int = 0) -> ModelMetrics:
        """One model's share, every labelled series it can produce created at zero, so that replicas of one
        configuration expose the same label sets from their first scrape (routers that merge replicas'
        metrics refuse mismatched ones). A fresh share for each load: the counts it takes from the actors
        at a scrape (ModelMetrics.refresh) start from the new allocator's zero."""
        return ModelMetrics(self, model_name, num_spec_positions=num_spec_positions)

    def on_scrape(self, refresh: Callable[[], None]) -> None:
        self._refreshers.append(refresh)

    def refresh(self) -> None:
        """Bring the gauges read from the actors up to date (what a scrape does first)."""
        for refresh in self._refreshers:
            refresh()

    def render(self) -> bytes:
        self.refresh()
        return generate_latest(self.registry)


class ModelMetrics:
    """The series of one served model: what its actors and its responses observe. Each attribute below is
    the daemon's family of that name with this model's `model_name`; a family with further labels is a
    Labelled (`.labels(reason=...)`)."""

    num_requests_running: Gauge
    num_requests_waiting: Gauge
    kv_cache_usage_perc: Gauge
    prompt_tokens: Counter
    generation_tokens: Counter
    request_success: Labelled
    request_aborted: Labelled
    request_failed: Counter
    slow_reader_aborts: Counter
    num_preemptions: Counter
    fair_preemptions: Counter
    prefix_cache_hit_rate: Gauge
    prefix_cache_queries: Counter
    prefix_cache_hits: Counter
    prefix_cache_misses: Labelled
    kv_events_published: Counter
    kv_events_dropped: Counter
    kv_disk_hits: Counter
    kv_disk_misses: Counter
    kv_disk_bad_files: Counter
    kv_disk_bytes_read: Counter
    kv_disk_bytes_written: Counter
    kv_disk_blocks_written: Counter
    kv_disk_writes_dropped: Counter
    kv_disk_blocks: Gauge
    kv_disk_bytes: Gauge
    kv_disk_read_seconds: Histogram
    time_to_first_token: Histogram
    inter_token_latency: Histogram
    time_per_output_token: Histogram
    e2e_request_latency: Histogram
    request_queue_time: Histogram
    iteration_tokens: Histogram
    step_duration: Histogram
    spec_num_drafts: Counter
    spec_num_draft_tokens: Counter
    spec_num_accepted_tokens: Counter
    spec_accepted_per_pos: Labelled
    kernels: Labelled

    def __init__(self, metrics: Metrics, model_name: str, *, num_spec_positions: int = 0) -> None:
        m = metrics
        self.model_name = model_name
        for attr, kind in ModelMetrics.__annotations__.items():    # the names above (annotations are strings)
            family = getattr(m, attr)
            setattr(self, attr, Labelled(family, model_name) if kind == "Labelled"
                    else family.labels(model_name=model_name))
        self.recent_ttft, self.recent_itl, self.recent_tpot = m.recent_ttft, m.recent_itl, m.recent_tpot
        self._daemon = m
        self._kernels: tuple[str, str, str] | None = None
        self._seen: dict[str, int] = {}               # the allocator's and publisher's counts at the last scrape
        for reason in ("stop", "length"):
            self.request_success.labels(finished_reason=reason)
        for phase in ("queued", "prefill", "decode"):
            self.request_aborted.labels(phase=phase)
        for miss in MISS_REASONS:
            self.prefix_cache_misses.labels(reason=miss)
        for pos in range(num_spec_positions):
            self.spec_accepted_per_pos.labels(position=str(pos))

    def describe(self, *, kernels: str, numerics: str, attention: str, block_size: int, num_blocks: int,
                 cache_dtype: str, prefix_caching: bool) -> None:
        """Its kernels (forge:kernels_info) and its K/V cache's layout (vllm:cache_config_info)."""
        self.kernels.labels(backend=kernels, numerics=numerics, attention=attention).set(1)
        self._kernels = (kernels, numerics, attention)
        self._daemon.cache_configs[self.model_name] = {
            "block_size": str(block_size), "num_gpu_blocks": str(num_blocks), "cache_dtype": cache_dtype,
            "enable_prefix_caching": str(prefix_caching)}

    def refresh(self, stats: CoreStats, cache: CacheStats, events: KvEventPublisherStats | None = None) -> None:
        """The gauges from its scheduler's and allocator's statistics, and the counts kept there (the prefix
        cache's, the KV events') carried into the counters (what a scrape does first)."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        used = cache.num_total_blocks - cache.num_free_blocks
        self.kv_cache_usage_perc.set(used / cache.num_total_blocks if cache.num_total_blocks else 0.0)
        self.prefix_cache_hit_rate.set(cache.prefix_hit_rate)
        self._count(self.prefix_cache_queries, "queries", cache.prefix_queries)
        self._count(self.prefix_cache_hits, "hits", cache.prefix_hits)
        for reason, total in cache.prefix_misses:
            self._count(self.prefix_cache_misses.labels(reason=reason), f"miss:{reason}", total)
        if events is not None:
            self._count(self.kv_events_published, "kv_published", events.num_published)
            self._count(self.kv_events_dropped, "kv_dropped", events.num_dropped)

    def refresh_disk(self, disk: DiskTierStats, read_seconds: list[float]) -> None:
        """The disk tier's counts carried into the counters, its size into the gauges, its loads' times observed."""
        for counter, key, total in ((self.kv_disk_hits, "disk_hits", disk.hit_blocks),
                                    (self.kv_disk_misses, "disk_misses", disk.miss_blocks),
                                    (self.kv_disk_bad_files, "disk_bad", disk.bad_files),
                                    (self.kv_disk_bytes_read, "disk_read", disk.bytes_read),
                                    (self.kv_disk_bytes_written, "disk_written", disk.bytes_written),
                                    (self.kv_disk_blocks_written, "disk_blocks_written", disk.blocks_written),
                                    (self.kv_disk_writes_dropped, "disk_dropped", disk.writes_dropped)):
            self._count(counter, key, total)
        self.kv_disk_blocks.set(disk.files)
        self.kv_disk_bytes.set(disk.bytes_on_disk)
        for seconds in read_seconds:
            self.kv_disk_read_seconds.observe(seconds)

    def unloaded(self) -> None:
        """Its model is gone: nothing running, waiting or held, no kernels in use (counters keep their totals)."""
        for gauge in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage_perc):
            gauge.set(0)
        if self._kernels is not None:
            self._daemon.kernels.remove(self.model_name, *self._kernels)
            self._kernels = None
        self._daemon.cache_configs.pop(self.model_name, None)

    def _count(self, counter: Counter, key: str, total: int) -> None:
        counter.inc(total - self._seen.get(key, 0))
        self._seen[key] = total
