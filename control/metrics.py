"""An engine's kvbaton metrics in Prometheus form, served by its sidecar (`metrics_port`).

The sidecar owns the numbers (the ledger's counters, its peer refusals, the transport's and the
history copier's books), so it renders them: a scrape is answered from the sidecar's own event
loop and never touches vLLM's engine loop. Why not vLLM's own `/metrics`: with one API server
vLLM renders only its API-server process's registry (it sets up prometheus_client's
multiprocess directory only when it runs several API servers), and the sidecar is another
process; vLLM's connector-stats path carries interval deltas from the worker through the engine
step, which ties every number to engine steps and to `log_stats`.

`snapshot` (in the sidecar) builds a plain dict; `families(snapshot)` turns it into metric
families and `render(snapshot)` into the text format, so the mapping is tested without a
sidecar. `serve(host, port, snapshot_fn)` is the small HTTP server: `GET /metrics` only, bounded
request size, time and connections.

Every metric is named `kvbaton_*` and labelled with the engine id. Counters never go down for
the sidecar's life (the ledger prunes ended records, never their counts).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..core import lease as lease_machine
from ..core import load as load_machine
from ..core import ticket as ticket_machine


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Live record states shown even at zero, so a dashboard's series exist from the first scrape: the
# machines' own (core), never a copy.
TICKET_STATES = tuple(s for s in ticket_machine.SPEC.states if s not in ticket_machine.SPEC.terminal)
LOAD_STATES = tuple(s for s in load_machine.SPEC.states if s not in load_machine.SPEC.terminal)
LEASE_STATES = tuple(s for s in lease_machine.SPEC.states if s not in lease_machine.SPEC.terminal)
# Ended records the ledger keeps a while before pruning them: counted by the *_ended and
# *_closed counters, never shown as open.
ENDED_STATES = ticket_machine.SPEC.terminal | load_machine.SPEC.terminal | lease_machine.SPEC.terminal
# How a load ended, as the ledger counts it (`loads.<state>`).
LOAD_OUTCOMES = ("done", "missed", "failed", "cancelled")
LEASE_OUTCOMES = ("released", "expired", "cancelled")
TIERS = ("gpu", "cpu")
CHECKSUM_RESULTS = ("summed", "sum_failed", "verified", "mismatch", "check_failed", "unverified")
SESSION_EVENTS = ("opened", "turns", "prefetches", "refreshed", "expired", "closed", "keep_clamped")


def _prefixed(counters: dict, prefix: str) -> Iterable[tuple[str, float]]:
    for name, value in sorted(counters.items()):
        if name.startswith(prefix) and len(name) > len(prefix):
            yield name[len(prefix):], value


def _label(text: str) -> str:
    """A reason as a label value: the ledger's words ("not the claimer") with underscores."""
    return str(text).strip().replace(" ", "_")


def families(snap: dict) -> list:
    """Metric families for one sidecar snapshot (see `Sidecar.metrics_snapshot`)."""

    engine = str(snap.get("engine", ""))
    counters: dict = snap.get("counters", {}) or {}
    out: list = []

    def counter(name: str, doc: str, value: float | None = None, labels: tuple = (),
                rows: Iterable[tuple[tuple, float]] = ()) -> None:
        family = CounterMetricFamily(name, doc, labels=["engine", *labels])
        if value is not None:
            family.add_metric([engine], value)
        for values, amount in rows:
            family.add_metric([engine, *values], amount)
        out.append(family)

    def gauge(name: str, doc: str, labels: tuple, rows: Iterable[tuple[tuple, float]]) -> None:
        family = GaugeMetricFamily(name, doc, labels=["engine", *labels])
        for values, amount in rows:
            family.add_metric([engine, *values], amount)
        out.append(family)

    info = GaugeMetricFamily("kvbaton_sidecar_info", "This engine's kvbaton sidecar (value 1)",
                             labels=["engine", "role"])
    info.add_metric([engine, str(snap.get("role", ""))], 1)
    out.append(info)
    lag = snap.get("loop_lag") or {}
    if lag.get("buckets"):
        late = HistogramMetricFamily(
            "kvbaton_sidecar_loop_lag_seconds", "How late the sidecar's timer woke, every tick_interval_s: "
            "facts from the engine and peer calls wait on the same loop, so lag here delays claims and loads",
            labels=["engine"])
        late.add_metric([engine], [(str(bound), n) for bound, n in lag["buckets"]] + [("+Inf", lag["count"])],
                        sum_value=lag.get("sum_s", 0.0))
        out.append(late)

    def by_state(kind: str, known: tuple) -> list[tuple[tuple, float]]:
        states = dict.fromkeys(known, 0)
        states.update({s: n for s, n in (snap.get(kind, {}) or {}).items() if s not in ENDED_STATES})
        return [((state,), n) for state, n in sorted(states.items())]

    # -- tickets (P) ----------------------------------------------------------------------------
    gauge("kvbaton_tickets", "Open handoff tickets on this engine (P), by state", ("state",),
          by_state("tickets", TICKET_STATES))
    counter("kvbaton_tickets_issued", "Handoff tickets issued (P)", counters.get("tickets.issued", 0))
    counter("kvbaton_tickets_claimed", "Handoff tickets claimed by a decode engine (P)",
            counters.get("tickets.claimed", 0))
    counter("kvbaton_tickets_closed", "Handoff tickets closed (P), by how they closed", labels=("reason",),
            rows=[((_label(r),), n) for r, n in _prefixed(counters, "tickets.closed.")])
    counter("kvbaton_ticket_reads", "Reads of this engine's tickets by decode engines (P), by result",
            labels=("result",), rows=[((r,), counters.get(f"reads.finished.{r}", 0)) for r in ("ok", "failed")])
    refused_claims = [(("unknown_ticket",), counters.get("claims.refused.unknown_ticket", 0)),
                      (("other",), counters.get("claims.refused", 0))]
    counter("kvbaton_claims_refused", "Claims this engine refused (P): unknown ticket, or claimed by "
            "another, released or closed", labels=("reason",), rows=refused_claims)

    # -- loads (D) --------------------------------------------------------------------------------
    gauge("kvbaton_loads", "Handoff loads in progress on this engine (D), by state", ("state",),
          by_state("loads", LOAD_STATES))
    counter("kvbaton_loads_requested", "Requests that arrived with a handoff (D)",
            counters.get("loads.requested", 0))
    counter("kvbaton_loads_ended", "Handoff loads ended (D), by outcome: done (read), missed or failed "
            "(recomputed), cancelled", labels=("outcome",),
            rows=[((o,), counters.get(f"loads.{o}", 0)) for o in LOAD_OUTCOMES])
    transfer = snap.get("transfer", {}) or {}
    counter("kvbaton_loads_synchronous", "Handoff loads vLLM ran in the step that allocated them (D): "
            "the step waited for the read (the rest were parked until a later step)",
            counters.get("loads.sync", 0))
    counter("kvbaton_loads_mode", "How D ran its granted loads: in_step (synchronous) or parked, and why "
            "parked (off, cold_peer, seeded, busy, long_read)", labels=("mode",),
            rows=[((mode,), n) for mode, n in sorted((snap.get("load_modes") or {}).items())])
    counter("kvbaton_loads_sync_wait_passed", "Synchronous loads whose read was not posted within "
            "sync_load_wait_s (D): the step ran without it, the request recomputed, and the read was never posted "
            "(one per worker rank)", transfer.get("sync_wait_passed", 0))
    failed = transfer.get("failed", 0)
    counter("kvbaton_handoff_reads", "Handoff reads this engine made (D), by result", labels=("result",),
            rows=[(("ok",), max(0, transfer.get("reads", 0) - failed)), (("failed",), failed)])
    counter("kvbaton_handoff_bytes", "Bytes read by this engine's successful handoff reads (D)",
            transfer.get("bytes", 0))
    counter("kvbaton_handoff_seconds", "Seconds spent in this engine's successful handoff reads (D), "
            "summed over reads", transfer.get("seconds", 0.0))

    checksums = snap.get("checksums", {}) or {}
    counter("kvbaton_handoff_checksums", "kv_checksums: tickets whose blocks P summed (summed; sum_failed "
            "per rank), and each worker rank's reads on D: checked (verified, mismatch: recomputed), "
            "failed to sum here (check_failed: recomputed), or not checked (unverified, per read: no "
            "sums with the grant)", labels=("result",),
            rows=[((r,), checksums.get(r, 0)) for r in CHECKSUM_RESULTS])
    counter("kvbaton_handoff_checksum_mismatches", "Reads whose blocks did not sum to P's (D), by P's "
            "engine id: each recomputed", labels=("peer",),
            rows=[((_label(peer),), n) for peer, n in sorted((snap.get("checksum_mismatches") or {}).items())])

    # -- history (P) ------------------------------------------------------------------------------
    counter("kvbaton_history_hits", "Revisits whose prefix history restored (P), by the tier of its "
            "last block", labels=("tier",),
            rows=[((t,), counters.get(f"restores.hits.{t}", 0)) for t in TIERS])
    counter("kvbaton_history_misses", "Revisits that asked history and found nothing to restore (P)",
            counters.get("restores.miss", 0))
    counter("kvbaton_history_dropped_blocks", "Blocks history left out or let go (P), by reason",
            labels=("reason",), rows=[((_label(r),), n) for r, n in _prefixed(counters, "history.dropped.")])
    counter("kvbaton_history_published_blocks", "Blocks history kept (P)", counters.get("history.published", 0))
    counter("kvbaton_history_demoted_blocks", "Blocks history moved from the GPU to the CPU tier (P)",
            counters.get("history.demotions", 0))
    io = snap.get("history_io", {}) or {}
    restore_failed = io.get("restores_failed", 0)
    counter("kvbaton_restores", "History restores copied into engine blocks (P), by result",
            labels=("result",), rows=[(("ok",), max(0, io.get("restores", 0) - restore_failed)),
                                      (("failed",), restore_failed)])
    counter("kvbaton_restore_bytes", "Bytes copied by successful history restores (P)", io.get("restore_bytes", 0))
    counter("kvbaton_restore_seconds", "Seconds spent in successful history restores (P)",
            io.get("restore_seconds", 0.0))
    counter("kvbaton_restored_blocks", "Blocks restored from history (P), by tier", labels=("tier",),
            rows=[((t,), io.get(f"restored_{t}_blocks", 0)) for t in TIERS])
    counter("kvbaton_leases_reserved", "History restore leases reserved (P)", counters.get("leases.reserved", 0))
    counter("kvbaton_leases_ended", "History restore leases ended (P), by outcome: released (used or "
            "given back), expired, cancelled",
            labels=("outcome",), rows=[((o,), counters.get(f"leases.{o}", 0)) for o in LEASE_OUTCOMES])
    gauge("kvbaton_leases", "Open history restore leases (P), by state", ("state",),
          by_state("leases", LEASE_STATES))
    gate = snap.get("gate", {}) or {}
    counter("kvbaton_history_gate", "The restore gate's choices for prefixes history holds (P): restore "
            "or recompute, and why (unmeasured, faster, slower, explore)", labels=("choice", "reason"),
            rows=[(tuple(key.split(".", 1)), n) for key, n in sorted((gate.get("decisions") or {}).items())
                  if "." in key])
    gauge("kvbaton_history_gate_step_seconds", "The restore gate's fit of this engine's steps (P): "
          "seconds = fixed + per_token x scheduled tokens", ("part",),
          [(("fixed",), gate.get("step_fixed_s", 0.0)), (("per_token",), gate.get("step_per_token_s", 0.0))])
    gauge("kvbaton_history_gate_restore_seconds", "The restore gate's fit of a restore's wait (P), from "
          "asking history to the step that schedules the request: fixed part, and copy seconds per "
          "block by tier", ("part",),
          [(("fixed",), gate.get("restore_fixed_s", 0.0))] +
          [((f"per_block_{t}",), (gate.get("restore_per_block_s") or {}).get(t, 0.0)) for t in TIERS])
    gauge("kvbaton_history_gate_samples", "Measurements behind the restore gate's fits (P)", ("kind",),
          [(("steps",), gate.get("steps", 0)), (("restores",), gate.get("restores", 0))])
    counter("kvbaton_history_promoted_blocks", "Blocks a session's prefetch moved from the CPU back to "
            "the GPU tier (P), by result", labels=("result",),
            rows=[(("ok",), counters.get("history.promoted", 0)),
                  (("failed",), counters.get("history.promotions_failed", 0))])
    counter("kvbaton_sessions", "Agent sessions (P): opened, turns kept, prefetches, keep times refreshed by "
            "the router (a turn D alone served), and how they "
            "ended (expired, closed)", labels=("event",),
            rows=[((e,), counters.get(f"sessions.{e}", 0)) for e in SESSION_EVENTS])
    counter("kvbaton_sessions_trimmed_blocks", "Blocks a session turn could not keep (P), by bound: "
            "session (session_bytes_max) or total (sessions_bytes_max)", labels=("bound",),
            rows=[((b,), counters.get(f"sessions.trimmed.{b}", 0)) for b in ("session", "total")])
    sessions = snap.get("sessions", {}) or {}
    gauge("kvbaton_sessions_open", "Agent sessions P keeps now", (), [((), sessions.get("open", 0))])
    gauge("kvbaton_sessions_kept_blocks", "History blocks agent sessions keep now (P)", (),
          [((), sessions.get("kept_blocks", 0))])
    history = snap.get("history", {}) or {}
    gauge("kvbaton_history_used_bytes", "Bytes history holds (P), by tier", ("tier",),
          [((t,), history.get(f"{t}_used_bytes", 0)) for t in TIERS])
    gauge("kvbaton_history_budget_bytes", "History budget (P), by tier", ("tier",),
          [((t,), history.get(f"{t}_budget_bytes", 0)) for t in TIERS])
    gauge("kvbaton_history_blocks", "Blocks history holds or is copying (P), by tier", ("tier",),
          [((t,), history.get(f"{t}_blocks", 0)) for t in TIERS])

    # -- refusals ---------------------------------------------------------------------------------
    counter("kvbaton_handoffs_refused", "Handoff sections this engine refused before claiming (D: "
            "invalid, unsigned, forged, expired, untrusted_control, layout, tensor_parallel, weights; "
            "each request recomputed), or handoffs it would not make (P: no_router_capability)", labels=("reason",),
            rows=[((_label(r),), n) for r, n in sorted((snap.get("handoffs_refused") or {}).items())])
    counter("kvbaton_peer_refused", "Peer calls and connections this sidecar refused, by reason",
            labels=("reason",), rows=[((_label(r),), n) for r, n in sorted((snap.get("refused") or {}).items())])
    counter("kvbaton_rejected_events", "Events the ledger answered Rejected (lifecycle races, late or "
            "duplicate facts), by reason", labels=("reason",),
            rows=[((_label(r),), n) for r, n in _prefixed(counters, "rejected.")])
    return out


class _Snapshot:
    """A prometheus_client collector over a snapshot function."""

    def __init__(self, snapshot_fn: Callable[[], dict]) -> None:
        self.snapshot_fn = snapshot_fn

    def collect(self):
        yield from families(self.snapshot_fn())


def registry_for(snapshot_fn: Callable[[], dict]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(snapshot_fn))
    return registry


def render(snap: dict) -> bytes:
    """The Prometheus text format of one snapshot."""
    return generate_latest(registry_for(lambda: snap))


# A scrape is a few hundred bytes of request: anything longer, slower or more numerous is
# dropped, so the port cannot be used to hold the sidecar's memory or connections.
MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 16


async def serve(host: str, port: int, snapshot_fn: Callable[[], dict]) -> asyncio.AbstractServer:
    """Serve `GET /metrics` at host:port from the running event loop; raises OSError when the
    port cannot be bound. The snapshot is taken in the loop, between the sidecar's own events."""

    from .http_server import plain
    from .http_server import serve as serve_http

    registry = registry_for(snapshot_fn)

    def handler(method: str, path: str, headers: dict, body: bytes):
        if method not in ("GET", "HEAD"):
            return plain("405 Method Not Allowed", "only GET\n")
        if path != "/metrics":
            return plain("404 Not Found", "see /metrics\n")
        return "200 OK", CONTENT_TYPE, generate_latest(registry), {}

    return await serve_http(host, port, handler, max_connections=MAX_CONNECTIONS, timeout_s=REQUEST_TIMEOUT_S,
                            max_head_bytes=MAX_REQUEST_BYTES, what="a metrics scrape")
