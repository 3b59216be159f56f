"""Prometheus metrics of the live caches, for `python -m moecache.serve`'s /metrics: hits,
misses, uploads, evictions and late uploads per layer (with the miss planner, its lane misses
and the uploads it declined), upload bytes, link bytes per decode token, hit ratio, step time, the cache's size and
the planner's rates, one `context` label per live cache. Names follow llama.cpp server's own
/metrics (`llamacpp:prompt_tokens_total`, ...): `moecache:hits_total`, ..."""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PER_LAYER = {  # stats counter -> help
    "hits": "Expert lookups served by the device cache",
    "misses": "Expert lookups the device cache did not hold (on the CPU, or through the lane)",
    "uploads": "Experts uploaded into the cache",
    "evictions": "Experts evicted from the cache",
    "late": "Uploads not complete at the boundary they were due",
    "prefill_uploads": "Uploads of the prompt's experts",
    "lane_misses": "Misses the device computed through the copy-on-miss lane (counted in misses too)",
    "declined": "Eager uploads the miss planner declined: they would not pay back their link time",
}
PER_CACHE_COUNTERS = {  # stats counter -> help; upload_bytes is one of the stats' totals
    "decode_steps": "Decode steps the cache observed",
    "decode_tokens": "Tokens in those steps",
    "prefill_tokens": "Prompt tokens the cache observed",
    "upload_bytes": "Bytes uploaded into the cache",
}


class CacheCollector:
    """Collects from caches() at each scrape: the numbers are the caches' own stats()."""

    def __init__(self, caches: Callable[[], Iterable]):
        self.caches = caches

    def collect(self):
        layer_families = {name: CounterMetricFamily(f"moecache:{name}", text, labels=["context", "layer"])
                          for name, text in PER_LAYER.items()}
        cache_families = {name: CounterMetricFamily(f"moecache:{name}", text, labels=["context"])
                          for name, text in PER_CACHE_COUNTERS.items()}
        ratio = GaugeMetricFamily("moecache:hit_ratio", "Hits per decode lookup", labels=["context"])
        step = GaugeMetricFamily("moecache:step_seconds_mean", "Mean time of the cache's step between graphs",
                                 labels=["context"])
        size = GaugeMetricFamily("moecache:device_bytes", "Device memory of the cache", labels=["context"])
        slots = GaugeMetricFamily("moecache:slots", "Experts cached per layer", labels=["context"])
        link = GaugeMetricFamily("moecache:link_bytes_per_token", "Bytes uploaded per decode token",
                                 labels=["context"])
        rates = GaugeMetricFamily("moecache:planner_gbps", "The miss planner's rates, GB/s",
                                  labels=["context", "rate"])
        payback = GaugeMetricFamily("moecache:planner_payback_uses",
                                    "Uses an eager upload must bring beyond its victim's", labels=["context"])
        for index, cache in enumerate(self.caches()):
            stats, context = cache.stats(), str(index)
            for layer in stats["layers"]:
                for name, family in layer_families.items():
                    if name in layer:  # declined: with the planner only
                        family.add_metric([context, str(layer["layer"])], layer[name])
            for name, family in cache_families.items():
                family.add_metric([context], stats[name] if name in stats else stats["totals"][name])
            if stats["hit_rate"] is not None:
                ratio.add_metric([context], stats["hit_rate"])
            step.add_metric([context], (stats["step_us_mean"] or 0) / 1e6)
            size.add_metric([context], stats["device_bytes"])
            slots.add_metric([context], stats["slots"])
            if stats.get("link_bytes_per_token") is not None:
                link.add_metric([context], stats["link_bytes_per_token"])
            if stats.get("planner"):
                for rate in ("link", "host", "dram"):
                    rates.add_metric([context, rate], stats["planner"][f"{rate}_gbps"])
                payback.add_metric([context], stats["planner"]["payback_uses"])
        yield from layer_families.values()
        yield from cache_families.values()
        yield from (ratio, step, size, slots, link, rates, payback)


def exposition(caches: Callable[[], Iterable]) -> bytes:
    """The Prometheus text of these caches now."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CacheCollector(caches))
    return generate_latest(registry)
