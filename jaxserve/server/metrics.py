"""The Prometheus metrics of one server, in a registry of its own (not prometheus-client's global one, so
servers built in one process do not share counters), named like vLLM's (`jaxserve:` for `vllm:`).

The front end updates them on the event loop, from the engine driver's events: the gauges and the
prefix-cache and preemption counters after every round of steps (with data parallelism, of all the
replicas: summed, KV usage averaged, the prefix hit rate over their lookups together), the token counters,
the finished-request counter and the latency histograms when a request finishes (its final output,
whatever ended it: a disconnected client's request counts as "abort").
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxserve.sampling import RequestOutput

if TYPE_CHECKING:
    from jaxserve.replicas import ReplicaStats

# vLLM's buckets.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """Every metric, labelled with the served model name (and finished_reason for request_success)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        registry, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"jaxserve:{name}", doc, labels, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"jaxserve:{name}", doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"jaxserve:{name}", doc, labels, buckets=buckets, registry=registry).labels(model_name)

        self.running = gauge("num_requests_running", "Sequences in the engine's running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be admitted (or recomputed).")
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of the KV pool's blocks held by sequences (1 = full).")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Sequences preempted (their KV freed, recomputed later).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the finished requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated for the finished requests.")
        self._success = Counter(
            "jaxserve:request_success", "Finished requests by reason.", [*labels, "finished_reason"], registry=registry
        )
        self._model_name = model_name
        self.ttft = histogram("time_to_first_token_seconds", "From arrival to the first token.", _TTFT_BUCKETS)
        self.tpot = histogram(
            "time_per_output_token_seconds", "Per request: (last token - first token) / (tokens - 1).", _TPOT_BUCKETS
        )
        self.latency = histogram("e2e_request_latency_seconds", "From arrival to the last token.", _LATENCY_BUCKETS)
        # Each replica's cumulative (queried, hit, preemptions) already counted.
        self._seen: dict[int, tuple[int, int, int]] = {}

    def observe_step(self, stats: Sequence[ReplicaStats]) -> None:
        """The replicas' state after a round of steps."""
        self.running.set(sum(s.running for s in stats))
        self.waiting.set(sum(s.waiting for s in stats))
        self.kv_usage.set(sum(s.kv_usage for s in stats) / len(stats))
        queried_tokens = sum(s.queried_tokens for s in stats)
        hit_tokens = sum(s.hit_tokens for s in stats)
        self.prefix_hit_rate.set(hit_tokens / queried_tokens if queried_tokens else 0.0)
        for replica, replica_stats in enumerate(stats):
            now = (replica_stats.queried_tokens, replica_stats.hit_tokens, replica_stats.preemptions)
            seen = self._seen.get(replica, (0, 0, 0))
            queried, hits, preemptions = (max(0, a - b) for a, b in zip(now, seen, strict=True))
            self.prefix_queries.inc(queried)
            self.prefix_hits.inc(hits)
            self.preemptions.inc(preemptions)
            self._seen[replica] = now

    def observe_finished(self, output: RequestOutput, arrival: float | None, reason: str | None = None) -> None:
        """A request's final output; arrival: when the server received it (time.monotonic), None: the
        engine's arrival time. reason overrides the finish reason (the server's "error" for a failed step)."""
        metrics = output.metrics
        arrival = metrics.arrival_time if arrival is None else arrival
        samples = output.outputs
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(sum(len(s.token_ids) for s in samples))
        finished = reason or (samples[0].finish_reason if samples else None) or "abort"
        self._success.labels(self._model_name, finished).inc()
        end = metrics.finished_time if metrics.finished_time is not None else time.monotonic()
        self.latency.observe(max(0.0, end - arrival))
        if metrics.first_token_time is None:
            return
        self.ttft.observe(max(0.0, metrics.first_token_time - arrival))
        num_tokens = max(len(s.token_ids) for s in samples)
        if num_tokens > 1:
            self.tpot.observe(max(0.0, end - metrics.first_token_time) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
