"""Prometheus metrics, named after vLLM's with an `llmlower:` prefix.

Gauges and counters are read from the engine's own counters when /metrics is scraped (so they can never
drift from it); histograms are observed from each finished request's timing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..runtime import EngineStats, GenerationResult
from ..runtime.speculative import SpeculationStats

PREFIX = "llmlower:"
FINISH_REASONS = ("stop", "length", "abort")  # vLLM's request_success_total labels
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class EngineCollector(Collector):
    """The engine's counters at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], model: str) -> None:
        self.stats, self.model = stats, model

    def collect(self) -> Iterator:
        stats = self.stats()
        labels = (["model_name"], [self.model])
        gauges = {
            "num_requests_running": ("requests in the running batch", stats.running),
            "num_requests_waiting": ("requests waiting to be admitted", stats.waiting),
            "kv_cache_usage_perc": ("share of the KV-cache blocks in use, 0..1", stats.kv_usage),
            "kv_cache_blocks_used": ("KV-cache blocks in use", stats.kv_blocks_used),
            "kv_cache_blocks_free": ("KV-cache blocks free (cached, unreferenced ones too)", stats.kv_blocks_free),
        }
        counters = {
            "prefix_cache_queries": ("prompt tokens looked up in the prefix cache", stats.prefix_cache_queries),
            "prefix_cache_hits": ("prompt tokens found in the prefix cache", stats.prefix_cache_hits),
            "num_preemptions": ("sequences preempted (freed and recomputed later)", stats.preemptions),
            "prompt_tokens": ("prompt tokens computed", stats.prompt_tokens),
            "generation_tokens": ("tokens generated", stats.generation_tokens),
        }
        for family, metrics in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, (text, value) in metrics.items():
                metric = family(PREFIX + name, text, labels=labels[0])
                metric.add_metric(labels[1], value)
                yield metric
        finished = CounterMetricFamily(
            PREFIX + "request_success", "completions finished, by reason", labels=[*labels[0], "finished_reason"]
        )
        for reason in FINISH_REASONS:
            finished.add_metric([*labels[1], reason], stats.finished.get(reason, 0))
        yield finished
        if stats.speculation is not None:
            yield from self._speculation(stats.speculation, labels)

    @staticmethod
    def _speculation(speculation: SpeculationStats, labels: tuple[list[str], list[str]]) -> Iterator:
        """Speculative decoding's counters (vLLM's spec_decode_* names), accepted tokens also by position."""
        counters = {
            "spec_decode_num_drafts": ("verification steps that had proposed tokens", speculation.drafts),
            "spec_decode_num_draft_tokens": ("tokens proposed", speculation.proposed),
            "spec_decode_num_accepted_tokens": ("proposed tokens accepted", speculation.accepted),
        }
        for name, (text, value) in counters.items():
            metric = CounterMetricFamily(PREFIX + name, text, labels=labels[0])
            metric.add_metric(labels[1], value)
            yield metric
        by_position = {
            "spec_decode_num_draft_tokens_per_pos": ("tokens proposed, by position", speculation.proposed_by_position),
            "spec_decode_num_accepted_tokens_per_pos": (
                "tokens accepted, by position",
                speculation.accepted_by_position,
            ),
        }
        for name, (text, counts) in by_position.items():
            metric = CounterMetricFamily(
                PREFIX + name, text + " (0: a proposal's first)", labels=[*labels[0], "position"]
            )
            for position, count in enumerate(counts):
                metric.add_metric([*labels[1], str(position)], count)
            yield metric


class Metrics:
    """A registry of its own (several apps may live in one process), the engine collector and the latency
    histograms."""

    def __init__(self, stats: Callable[[], EngineStats], model: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(stats, model))
        self.model = model

        def histogram(name: str, text: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, text, ["model_name"], registry=self.registry, buckets=buckets)

        self.ttft = histogram("time_to_first_token_seconds", "time to the first token", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "time between consecutive tokens", LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "arrival to last token", REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "arrival to the first step that ran it", REQUEST_BUCKETS)

    def observe(self, result: GenerationResult) -> None:
        """A finished completion's latencies."""
        timing = result.timing
        self.ttft.labels(self.model).observe(timing.ttft_s)
        self.e2e.labels(self.model).observe(timing.total_s)
        self.queue.labels(self.model).observe(timing.queue_s)
        itl = self.itl.labels(self.model)
        for gap in timing.inter_token_latencies_s:
            itl.observe(gap)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
