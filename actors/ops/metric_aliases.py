"""forge's metrics under vLLM's names too, for the routers and endpoint pickers that read a model server's
metrics by those names (the Gateway API Inference Extension's model-server protocol: queue depth, K/V usage,
the cache's layout; LLM-aware routers and dashboards: prefix-cache hits, tokens, latencies). Each `forge:` family
below is exposed again as `vllm:`, with its `model_name` label (the served name), at every scrape: the same
values, never a second count.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

# forge's name -> vLLM's (the families' base names; counters' _total samples follow).
ALIASES = {
    "forge:num_requests_running": "vllm:num_requests_running",
    "forge:num_requests_waiting": "vllm:num_requests_waiting",
    "forge:kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "forge:prefix_cache_queries": "vllm:prefix_cache_queries",
    "forge:prefix_cache_hits": "vllm:prefix_cache_hits",
    "forge:request_success": "vllm:request_success",
    "forge:prompt_tokens": "vllm:prompt_tokens",
    "forge:generation_tokens": "vllm:generation_tokens",
    "forge:num_preemptions": "vllm:num_preemptions",
    "forge:time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "forge:inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "forge:time_per_output_token_seconds": "vllm:time_per_output_token_seconds",
    "forge:e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "forge:request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "forge:iteration_tokens_total": "vllm:iteration_tokens_total",
}


class VllmAliases(Collector):
    """Collects `collectors` (forge's metric objects) and yields the aliased families, renamed; and
    vllm:cache_config_info from `cache_configs` (served name -> its cache's layout), read at each scrape."""

    def __init__(self, collectors: Iterable[Collector], cache_configs: dict[str, dict[str, str]]) -> None:
        self._collectors = list(collectors)
        self._cache_configs = cache_configs

    def collect(self) -> Iterator[Metric]:
        for collector in self._collectors:
            for family in collector.collect():
                alias = ALIASES.get(family.name)
                if alias is None:
                    continue
                out = Metric(alias, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    out.add_sample(alias + sample.name[len(family.name):], sample.labels, sample.value,
                                   sample.timestamp)
                yield out
        if self._cache_configs:
            info = Metric("vllm:cache_config_info", "The K/V cache's configuration.", "gauge")
            for model_name, config in list(self._cache_configs.items()):
                info.add_sample("vllm:cache_config_info", {**config, "model_name": model_name}, 1.0)
            yield info
