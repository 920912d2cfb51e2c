"""The router's routing decisions as Prometheus counters (`kvbaton_router_*`).

One helper for every routing policy, so round robin, cache-aware choice and conditional
disaggregation are counted under the same names and a dashboard compares them:

    metrics = RoutingMetrics(registry)
    metrics.routed("cache")                          # P chosen for the prefix it holds, then D
    metrics.routed("load")                           # P chosen for its load over a cache hit
    metrics.routed(None, disaggregated=False)        # D alone (it holds most of the prompt)
    metrics.parallel(n)                              # an n > 1 request on one handoff
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

# How the prefill engine was chosen: `round_robin` (no cache knowledge), `cache` (the longest
# resident prefix), `load` (a less loaded P over a cache hit), `fallback` (cache-aware routing
# had nothing to go on), `none` (no prefill: the request went to D alone).
PREFILL_CHOICES = ("round_robin", "cache", "load", "fallback", "session", "none")


class RoutingMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "kvbaton_router_routed", "Requests routed, by how P was chosen and whether the request was "
            "disaggregated (P then D) or sent to D alone", ["prefill", "disaggregated"], registry=registry)
        self.parallel_requests = Counter(
            "kvbaton_router_parallel_requests", "Requests with n > 1 served on one handoff",
            registry=registry)
        self.parallel_samples = Counter(
            "kvbaton_router_parallel_samples", "Samples asked for by requests with n > 1",
            registry=registry)
        # Series exist from the first scrape, so rates and ratios need no "absent" handling.
        for choice in PREFILL_CHOICES:
            self.decisions.labels(choice, "false" if choice == "none" else "true")

    def routed(self, prefill: str | None, *, disaggregated: bool = True) -> None:
        """Count one routing decision. `prefill` is one of PREFILL_CHOICES (None: "none")."""

        choice = prefill or "none"
        if choice not in PREFILL_CHOICES:
            raise ValueError(f"unknown prefill choice {choice!r} (one of {', '.join(PREFILL_CHOICES)})")
        self.decisions.labels(choice, "true" if disaggregated else "false").inc()

    def parallel(self, n: int) -> None:
        self.parallel_requests.inc()
        self.parallel_samples.inc(n)
