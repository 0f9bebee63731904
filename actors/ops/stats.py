"""What the dashboard shows (GET /stats): the daemon now, and its last ten minutes.

The numbers come from where /metrics reads them, the Prometheus registry's counters and the actors'
statistics(), so the page and a scrape agree. A sampler task records the counters once a second
into a bounded ring (HISTORY_SAMPLES); recent latencies are bounded windows of samples
(actors.ops.metrics.LatencyWindow). Nothing here touches the model or waits on an actor: a snapshot
is a read of plain counters on the event loop, between the engine's steps.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
from prometheus_client import Counter

from actors.ops.metrics import Metrics
from forge.engine.core import CoreStats
from forge.messages import CacheStats

SAMPLE_INTERVAL_S = 1.0
HISTORY_SAMPLES = 600          # ten minutes at one sample a second


@dataclass(slots=True, frozen=True)
class Sources:
    """What the stats read of one loaded model (the gateway's: the generation model used last)."""
    scheduler: Callable[[], CoreStats]
    cache: Callable[[], CacheStats]
    block_map: Callable[[], str]
    serving: dict[str, Any]        # the model and configuration, fixed for the daemon's life


@dataclass(slots=True, frozen=True)
class _Sample:
    at: float                      # unix seconds
    generation_tokens: float
    requests_finished: float
    running: int
    waiting: int
    kv_usage: float


def _total(counter: Counter) -> float:
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def _by_label(counter: Counter, label: str) -> dict[str, float]:
    """The counter's totals by one label, summed over the others (every model's, with several)."""
    out: dict[str, float] = {}
    for m in counter.collect():
        for s in m.samples:
            if s.name.endswith("_total") and label in s.labels:
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
    return out


class Stats:
    def __init__(self, metrics: Metrics, *, sources: Callable[[], Sources | None] = lambda: None) -> None:
        """`sources`: the model to read now (None while none is loaded: the page shows the counters only)."""
        self._metrics = metrics
        self._sources = sources
        self._started = time.monotonic()
        self._history: deque[_Sample] = deque(maxlen=HISTORY_SAMPLES)

    def sample(self) -> None:
        """Record the counters now (the sampler does this once a second)."""
        sources = self._sources()
        if sources is None:
            return
        core, cache = sources.scheduler(), sources.cache()
        m = self._metrics
        self._history.append(_Sample(
            at=time.time(), generation_tokens=_total(m.generation_tokens),
            requests_finished=_total(m.request_success), running=core.num_running, waiting=core.num_waiting,
            kv_usage=_usage(cache)))

    async def run_sampler(self) -> None:
        while True:
            self.sample()
            await anyio.sleep(SAMPLE_INTERVAL_S)

    def snapshot(self, status: str) -> dict[str, Any]:
        """The whole page's data: plain JSON types only."""
        m = self._metrics
        m.refresh()                   # the gauges and prefix-cache counters, as a scrape sees them
        out: dict[str, Any] = {"status": status, "time": time.time(),
                               "uptime_s": time.monotonic() - self._started}
        now = time.monotonic()
        out["latency"] = {"window_s": m.recent_ttft.window_s, "ttft": m.recent_ttft.percentiles(now),
                          "itl": m.recent_itl.percentiles(now), "tpot": m.recent_tpot.percentiles(now)}
        draft_tokens, accepted = _total(m.spec_num_draft_tokens), _total(m.spec_num_accepted_tokens)
        out["totals"] = {
            "prompt_tokens": _total(m.prompt_tokens), "generation_tokens": _total(m.generation_tokens),
            "requests_finished": _total(m.request_success), "preemptions": _total(m.num_preemptions),
            "fair_preemptions": _total(m.fair_preemptions),
            "prefix_cache_queries": _total(m.prefix_cache_queries), "prefix_cache_hits": _total(m.prefix_cache_hits),
            "spec_draft_tokens": draft_tokens, "spec_accepted_tokens": accepted}
        out["finished"] = _by_label(m.request_success, "finished_reason")
        out["errors"] = {"rejected": _by_label(m.request_rejected, "reason"),
                         "aborted": _by_label(m.request_aborted, "phase"), "failed": _total(m.request_failed)}
        out["spec_acceptance_rate"] = accepted / draft_tokens if draft_tokens else None
        sources = self._sources()
        if sources is None:
            return out
        core, cache = sources.scheduler(), sources.cache()
        block_map = sources.block_map()
        out["serving"] = sources.serving
        out["requests"] = {"running": core.num_running, "waiting": core.num_waiting}
        out["kv"] = {"total_blocks": cache.num_total_blocks, "free_blocks": cache.num_free_blocks,
                     "usage": _usage(cache), "prefix_cache_hit_rate": cache.prefix_hit_rate,
                     "counts": {state: block_map.count(state) for state in ".cus"}, "map": block_map}
        out["history"] = _history(list(self._history))
        return out


def _usage(cache: CacheStats) -> float:
    """What forge:kv_cache_usage_perc reports: blocks neither free nor cached-evictable."""
    total = cache.num_total_blocks
    return (total - cache.num_free_blocks) / total if total else 0.0


def _history(samples: list[_Sample]) -> dict[str, list[float]]:
    """Per-interval rates between consecutive samples, with the gauges at each sample's end."""
    out: dict[str, list[float]] = {"t": [], "tokens_per_s": [], "requests_per_s": [], "running": [],
                                   "waiting": [], "kv_usage": []}
    for prev, cur in zip(samples, samples[1:], strict=False):
        dt = cur.at - prev.at
        if dt <= 0:
            continue
        out["t"].append(round(cur.at, 3))
        out["tokens_per_s"].append(round((cur.generation_tokens - prev.generation_tokens) / dt, 2))
        out["requests_per_s"].append(round((cur.requests_finished - prev.requests_finished) / dt, 3))
        out["running"].append(cur.running)
        out["waiting"].append(cur.waiting)
        out["kv_usage"].append(round(cur.kv_usage, 4))
    return out
