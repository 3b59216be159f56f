"""Prometheus metrics of the live caches, for `python -m moecache.serve`'s /metrics: hits,
misses, uploads, evictions and late uploads per layer (with the miss planner, its lane misses
and the uploads it declined), per cache the upload bytes, link bytes per decode token, hit ratio,
step time, the cache's size and the planner's rates. Every series has a `context` label (one per
live cache) and a `tier` label: "device" (the slots on the device) or "ram" (the RAM tier's
experts in host memory, alone or under a device cache). The RAM tier adds its reads of the
model file, with a `phase` label ("prompt" or "decode"): bytes read, experts read ahead, of them
selected, the bytes of those not selected, and the time the layers waited for their reads.

Named by Prometheus's conventions: `moecache_` then snake case (colons are for recording
rules), the unit in the name in base units (`_bytes`, `_seconds`, `_bytes_per_second`),
counters ending in `_total`, the step time a `_sum`/`_count` pair (a summary without quantiles)
from which any window's mean is a rate ratio."""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

PER_LAYER = {  # stats counter -> (metric name, help)
    "hits": ("hits", "Expert lookups the cache served"),
    "misses": ("misses", "Expert lookups the cache did not hold (on the CPU, through the lane, or read from the file)"),
    "uploads": ("uploads", "Experts written into the cache"),
    "evictions": ("evictions", "Experts evicted from the cache"),
    "late": ("late_uploads", "Uploads not complete at the boundary they were due (each counted once)"),
    "prefill_uploads": ("prefill_uploads", "Uploads of the prompt's experts"),
    "lane_misses": ("lane_misses", "Misses the device computed through the copy-on-miss lane (counted in misses too)"),
    "declined": ("declined_uploads", "Eager uploads the miss planner declined: they would not pay back their link time"),
}
PER_CACHE_COUNTERS = {  # stats counter -> (metric name, help); upload_bytes is one of the stats' totals
    "decode_steps": ("decode_steps", "Decode steps the cache observed"),
    "decode_tokens": ("decode_tokens", "Tokens in those steps"),
    "prefill_tokens": ("prefill_tokens", "Prompt tokens the cache observed"),
    "upload_bytes": ("upload_bytes", "Bytes written into the cache"),
}
LABELS = ["context", "tier"]
READS = {  # the RAM tier's reads of the model file (its stats' "reads", per phase) -> (metric name, help, scale)
    "read_bytes": ("read_bytes", "Bytes the RAM tier read from the model file", 1),
    "read_ahead": ("read_ahead_experts", "Experts read ahead of their layer (the next layer's router, applied early)", 1),
    "read_ahead_used": ("read_ahead_used_experts", "Experts read ahead that their layer then selected", 1),
    "read_ahead_wasted_bytes": ("read_ahead_wasted_bytes", "Bytes read ahead for experts their layer did not select", 1),
    "read_wait_us": ("read_wait_seconds", "Time the layers' CPU matmuls waited for their reads", 1e-6),
}


def tiers(stats: dict) -> list[dict]:
    """A live cache's stats and, under a device cache, its RAM tier's: one per tier."""
    return [stats, *([stats["ram_tier"]] if stats.get("ram_tier") else [])]


class CacheCollector:
    """Collects from caches() at each scrape: the numbers are the caches' own stats()."""

    def __init__(self, caches: Callable[[], Iterable]):
        self.caches = caches

    def collect(self):
        layer_families = {key: CounterMetricFamily(f"moecache_{name}", text, labels=[*LABELS, "layer"])
                          for key, (name, text) in PER_LAYER.items()}
        cache_families = {key: CounterMetricFamily(f"moecache_{name}", text, labels=LABELS)
                          for key, (name, text) in PER_CACHE_COUNTERS.items()}
        ratio = GaugeMetricFamily("moecache_hit_ratio", "Hits per decode lookup", labels=LABELS)
        step = SummaryMetricFamily("moecache_step_seconds", "Time of the cache's step between graphs", labels=LABELS)
        size = GaugeMetricFamily("moecache_cache_bytes", "Memory of the cache: the device's (tier device), "
                                                         "the host's (tier ram)", labels=LABELS)
        slots = GaugeMetricFamily("moecache_slots", "Experts cached per layer", labels=LABELS)
        link = GaugeMetricFamily("moecache_link_bytes_per_token", "Bytes uploaded per decode token", labels=LABELS)
        rates = GaugeMetricFamily("moecache_planner_rate_bytes_per_second", "The miss planner's rates",
                                  labels=[*LABELS, "rate"])
        payback = GaugeMetricFamily("moecache_planner_payback_uses",
                                    "Uses an eager upload must bring beyond its victim's", labels=LABELS)
        reads = {key: CounterMetricFamily(f"moecache_{name}", text, labels=[*LABELS, "phase"])
                 for key, (name, text, _) in READS.items()}
        for index, cache in enumerate(self.caches()):
            for stats in tiers(cache.stats()):
                labels = [str(index), stats["tier"].lower()]
                for layer in stats["layers"]:
                    for key, family in layer_families.items():
                        if key in layer:  # declined, lane_misses: with the planner only
                            family.add_metric([*labels, str(layer["layer"])], layer[key])
                for key, family in cache_families.items():
                    family.add_metric(labels, stats[key] if key in stats else stats["totals"][key])
                if stats["hit_rate"] is not None:
                    ratio.add_metric(labels, stats["hit_rate"])
                step.add_metric(labels, count_value=stats["steps"],
                                sum_value=(stats["step_us_mean"] or 0) * stats["steps"] / 1e6)
                size.add_metric(labels, stats["device_bytes"])
                slots.add_metric(labels, stats["slots"])
                if stats.get("link_bytes_per_token") is not None:
                    link.add_metric(labels, stats["link_bytes_per_token"])
                if stats.get("planner"):
                    for rate in ("link", "host", "dram"):
                        rates.add_metric([*labels, rate], stats["planner"][f"{rate}_gbps"] * 1e9)
                    payback.add_metric(labels, stats["planner"]["payback_uses"])
                for phase, counts in (stats.get("reads") or {}).items():
                    if phase in ("prompt", "decode"):
                        for key, family in reads.items():
                            family.add_metric([*labels, phase], counts[key] * READS[key][2])
        yield from layer_families.values()
        yield from cache_families.values()
        yield from (ratio, step, size, slots, link, rates, payback)
        yield from reads.values()


def exposition(caches: Callable[[], Iterable]) -> bytes:
    """The Prometheus text of these caches now."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CacheCollector(caches))
    return generate_latest(registry)
