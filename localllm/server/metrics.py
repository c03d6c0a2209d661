"""Prometheus metrics of one server (its own registry: two servers in one process do not mix).

Per finished request: TTFT and TPOT histograms, prompt/completion/cached tokens, speculative drafts
and acceptances (acceptance = accepted / drafted, a ratio of the two counters). Per HTTP request: a count by route and status. Read when scraped: queue depth,
running sequences and KV-cache bytes of the loaded models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from localllm.types import Result

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class _Live:
    """A collector that asks the loaded models what they hold now, at scrape time."""

    def __init__(self, models: Callable[[], Iterable[tuple[str, Any]]],
                 queued: Callable[[str, Any], int]) -> None:  # fmt: skip
        self.models = models
        self.queued = queued

    def collect(self) -> Iterable[GaugeMetricFamily]:
        running = GaugeMetricFamily("localllm_running_sequences",
                                    "Sequences holding a slot (being decoded or prefilled)", labels=["model"])  # fmt: skip
        queue = GaugeMetricFamily("localllm_queue_depth",
                                  "Requests accepted and waiting for a slot", labels=["model"])  # fmt: skip
        kv = GaugeMetricFamily("localllm_kv_cache_bytes",
                               "Bytes the model's KV caches hold now", labels=["model"])  # fmt: skip
        for name, model in self.models():
            running.add_metric([name], getattr(model, "running", 0))
            queue.add_metric([name], self.queued(name, model))
            held = model.kv_bytes() if hasattr(model, "kv_bytes") else None
            if held is not None:
                kv.add_metric([name], held)
        yield running
        yield queue
        yield kv


class Metrics:
    def __init__(self, models: Callable[[], Iterable[tuple[str, Any]]],
                 queued: Callable[[str, Any], int]) -> None:  # fmt: skip
        r = self.registry = CollectorRegistry()
        self.requests = Counter("localllm_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)  # fmt: skip
        self.ttft = Histogram("localllm_ttft_seconds", "Time to first token",
                              ["model"], buckets=_TTFT_BUCKETS, registry=r)  # fmt: skip
        self.tpot = Histogram("localllm_tpot_seconds", "Time per output token after the first",
                              ["model"], buckets=_TPOT_BUCKETS, registry=r)  # fmt: skip
        self.prompt_tokens = Counter("localllm_prompt_tokens", "Prompt tokens in", ["model"], registry=r)
        self.completion_tokens = Counter("localllm_completion_tokens", "Tokens generated", ["model"],
                                         registry=r)  # fmt: skip
        self.cached_tokens = Counter("localllm_prefix_cache_hit_tokens",
                                     "Prompt tokens whose KV was reused from the prefix cache",
                                     ["model"], registry=r)  # fmt: skip
        self.drafted = Counter("localllm_speculative_drafted_tokens", "Tokens drafted", ["model"],
                               registry=r)  # fmt: skip
        self.accepted = Counter("localllm_speculative_accepted_tokens", "Drafted tokens accepted",
                                ["model"], registry=r)  # fmt: skip
        self.drafted_at = Counter("localllm_speculative_drafted_at_position",
                                  "Rounds that drafted a token at a draft position (1: the first)",
                                  ["model", "position"], registry=r)  # fmt: skip
        self.accepted_at = Counter("localllm_speculative_accepted_at_position",
                                   "Rounds whose draft at a draft position was accepted",
                                   ["model", "position"], registry=r)  # fmt: skip
        self.rejected = Counter("localllm_rejected_requests", "Requests refused by admission (503)",
                                ["model"], registry=r)  # fmt: skip
        r.register(_Live(models, queued))

    def observe(self, model: str, result: Result) -> None:
        u, t = result.usage, result.timings
        self.prompt_tokens.labels(model).inc(u.prompt_tokens)
        self.completion_tokens.labels(model).inc(u.completion_tokens)
        self.cached_tokens.labels(model).inc(u.cached_tokens)
        if u.completion_tokens:
            self.ttft.labels(model).observe(t.ttft_s)
        if u.completion_tokens > 1:
            self.tpot.labels(model).observe(t.tpot_s(u.completion_tokens))
        s = result.speculative
        if s is not None and s.drafted:
            self.drafted.labels(model).inc(s.drafted)
            self.accepted.labels(model).inc(s.accepted)
            for counter, counts in ((self.drafted_at, s.drafted_at), (self.accepted_at, s.accepted_at)):
                for i, n in enumerate(counts):
                    if n:
                        counter.labels(model, str(i + 1)).inc(n)

    def summary(self) -> dict[str, float]:
        """Totals over every model (for the app's Server screen): counts, mean TTFT and TPOT,
        acceptance, and what the loaded models hold now."""
        out: dict[str, float] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                if sample.name == "localllm_requests_total" and sample.labels.get("route") == "/metrics":
                    continue
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
        get = out.get
        ttft_n, tpot_n = get("localllm_ttft_seconds_count", 0), get("localllm_tpot_seconds_count", 0)
        drafted = get("localllm_speculative_drafted_tokens_total", 0)
        return {
            "requests": get("localllm_requests_total", 0),
            "refused": get("localllm_rejected_requests_total", 0),
            "prompt_tokens": get("localllm_prompt_tokens_total", 0),
            "completion_tokens": get("localllm_completion_tokens_total", 0),
            "cached_tokens": get("localllm_prefix_cache_hit_tokens_total", 0),
            "ttft_s": get("localllm_ttft_seconds_sum", 0) / ttft_n if ttft_n else 0.0,
            "tpot_s": get("localllm_tpot_seconds_sum", 0) / tpot_n if tpot_n else 0.0,
            "acceptance": get("localllm_speculative_accepted_tokens_total", 0) / drafted if drafted else 0.0,
            "running": get("localllm_running_sequences", 0),
            "queued": get("localllm_queue_depth", 0),
            "kv_bytes": get("localllm_kv_cache_bytes", 0),
        }

    def render(self) -> bytes:
        return generate_latest(self.registry)
