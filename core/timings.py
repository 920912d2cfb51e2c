"""Where a handoff's time goes: phase latencies read from engines' event logs.

Every event carries the shell's monotonic clock (`at_ns`), so one engine's log splits its own
lifecycles into phases, and the logs of a P and a D on one host (one clock) also join across the
handoff: ticket issued on P -> load requested on D. Pure: give it each log's role and events.

Phases (each a list of milliseconds, reported as count / P50 / P90 / max):

P (prefill), per ticket:
  p.issued_to_claim        ticket issued -> D's first claim
  p.claim_to_release       claim -> D's release (D held P's blocks this long)
  p.retention              release -> history published (the copies into the GPU tier); from
                           a release while a read was in flight, it includes that read's end
  p.demotion               an admission that made room in the GPU tier -> the last of its
                           demotions to the CPU tier ended (a retention publishes after them)
P, per history restore (a revisit):
  p.restore_to_allocated   restore asked -> vLLM allocated the blocks it lands in
  p.restore_copy           copies posted -> ended (a synchronous restore: until its step ended)
  p.restored_to_ticket     restore ended -> the request's ticket issued (P's engine computed the
                           rest of the prompt and finished the request)
  p.revisit_hit            restore asked -> ticket issued, when history restored the prefix
  p.revisit_miss           the same when it did not (P computed the whole prompt): a hit slower
                           than a miss means history costs this model more than it saves
D (decode), per load:
  d.queued                 vLLM's arrival stamp -> the connector's first look (D's API server
                           and its engine's input queue, as vLLM measured them)
  d.request_to_claim       load requested -> claim granted
  d.claim_to_allocated     claim granted -> vLLM allocated the destination blocks
  d.allocated_to_read      allocated -> read granted
  d.read                   read granted -> last read finished
  d.request_to_read_end    the whole load
P and D together (same host), per ticket:
  pd.ticket_to_load        P issued the ticket -> D asked for it (P's answer, the router, D's
                           scheduler)

Counters name what history dropped and why (replayed through the ledger, so they match what the
engine counted).
"""

from __future__ import annotations

from collections.abc import Iterable

from . import effects as fx
from . import events as ev
from .history import DEMOTING
from .ledger import Ledger, LedgerConfig

PHASES = (
    "p.issued_to_claim", "p.claim_to_release", "p.retention", "p.demotion",
    "p.restore_to_allocated", "p.restore_copy", "p.restored_to_ticket", "p.revisit_hit", "p.revisit_miss",
    "d.queued", "d.request_to_claim", "d.claim_to_allocated", "d.allocated_to_read", "d.read", "d.request_to_read_end",
    "pd.ticket_to_load",
)
COUNTER_PREFIXES = ("history.", "restores.", "tickets.closed.", "leases.", "loads.")


def _ms(later: int, earlier: int) -> float:
    return (later - earlier) / 1e6


class _Phases(dict):
    def add(self, name: str, value: float) -> None:
        self.setdefault(name, []).append(value)


def _prefill(events: Iterable[ev.Event], phases: _Phases, issued: dict[str, int],
             issuers: dict[str, str]) -> None:
    ticket_of: dict[str, str] = {}  # ticket -> request
    claimed: dict[str, int] = {}
    released: dict[str, int] = {}
    restores: dict[str, dict] = {}  # lease -> {request, asked, allocated, posted}
    restored_at: dict[str, int] = {}  # request -> its restore's end
    revisits: dict[str, int] = {}  # request -> when it first asked history for its prefix
    for e in events:
        kind = type(e)
        if kind is ev.TicketIssued or kind is ev.RetainRequested:
            if kind is ev.TicketIssued:
                issued[e.ticket] = e.at_ns
                issuers[e.ticket] = e.request
            else:  # a plain request's prompt: released as it is issued, its retention starts now
                released[e.ticket] = e.at_ns
            ticket_of[e.ticket] = e.request
            ended = restored_at.pop(e.request, None)
            if ended is not None:
                phases.add("p.restored_to_ticket", _ms(e.at_ns, ended))
            asked = revisits.pop(e.request, None)
            if asked is not None:
                phases.add("p.revisit_hit" if ended is not None else "p.revisit_miss", _ms(e.at_ns, asked))
        elif kind is ev.ClaimRequested:
            if e.ticket in issued and e.ticket not in claimed:
                claimed[e.ticket] = e.at_ns
                phases.add("p.issued_to_claim", _ms(e.at_ns, issued[e.ticket]))
        elif kind is ev.ReleaseRequested:
            if e.ticket in claimed and e.ticket not in released:
                released[e.ticket] = e.at_ns
                phases.add("p.claim_to_release", _ms(e.at_ns, claimed[e.ticket]))
        elif kind is ev.HistoryPublished:
            start = released.pop(e.ticket, None)
            if start is not None and e.ok:  # (a late one the deadline already dropped counts too)
                phases.add("p.retention", _ms(e.at_ns, start))
        elif kind is ev.RestoreRequested:
            if e.keys:
                restores[e.lease] = {"request": e.request, "asked": e.at_ns}
                revisits.setdefault(e.request, e.at_ns)
        elif kind is ev.LeaseAllocated:
            r = restores.get(e.lease)
            if r is not None and "allocated" not in r:
                r["allocated"] = e.at_ns
                phases.add("p.restore_to_allocated", _ms(e.at_ns, r["asked"]))
        elif kind is ev.LeaseReadStarted:
            r = restores.get(e.lease)
            if r is not None:
                r.setdefault("posted", e.at_ns)
        elif kind is ev.LeaseReadFinished:
            r = restores.pop(e.lease, None)
            if r is not None and "posted" in r:
                phases.add("p.restore_copy", _ms(e.at_ns, r["posted"]))
                if e.ok:
                    restored_at[r["request"]] = e.at_ns


def _decode(events: Iterable[ev.Event], phases: _Phases, requested: dict[str, int]) -> dict[str, dict]:
    """D's phases; returns each load's marks (ns) by request: asked, claimed, allocated, granted,
    read_end, with its ticket and vLLM's queue time (ms)."""

    loads: dict[str, dict] = {}
    for e in events:
        kind = type(e)
        if kind is ev.LoadRequested:
            loads[e.request] = {"asked": e.at_ns, "ticket": e.ticket, "queued_ms": e.queued_ns / 1e6}
            requested.setdefault(e.ticket, e.at_ns)
            if e.queued_ns > 0:
                phases.add("d.queued", e.queued_ns / 1e6)
            continue
        load = loads.get(getattr(e, "request", None))
        if load is None:
            continue
        if kind is ev.ClaimGranted and "claimed" not in load:
            load["claimed"] = e.at_ns
            phases.add("d.request_to_claim", _ms(e.at_ns, load["asked"]))
        elif kind is ev.LoadAllocated and "allocated" not in load:
            load["allocated"] = e.at_ns
            # Absent when the blocks came before the claim's answer (allocate_before_claim).
            if "claimed" in load:
                phases.add("d.claim_to_allocated", max(0.0, _ms(e.at_ns, load["claimed"])))
        elif kind is ev.ReadGranted and "granted" not in load:
            load["granted"] = e.at_ns
            if "allocated" in load:
                phases.add("d.allocated_to_read", _ms(e.at_ns, load["allocated"]))
        elif kind is ev.LoadReadFinished and e.ok:
            load["read_end"] = e.at_ns  # the last read's end wins
        elif kind in (ev.RequestAborted, ev.RequestPreempted) and "read_end" not in load:
            loads.pop(e.request, None)  # never read: no phase (a finished load keeps its own)
    for load in loads.values():
        if "granted" in load and "read_end" in load:
            phases.add("d.read", _ms(load["read_end"], load["granted"]))
            phases.add("d.request_to_read_end", _ms(load["read_end"], load["asked"]))
    return loads


def _slowest(loads: dict[str, dict], issued: dict[str, int], issuers: dict[str, str], count: int) -> list[dict]:
    """The `count` loads that ended last after their ticket was issued (after D asked, where P's
    log is not there), each split into its phases (ms; a phase it never reached is absent), with
    P's request (`p_request`) and each mark's clock reading (`at_ns`: "issued" on P, the rest on
    D) for joining other records of the same host."""

    marks = ("asked", "claimed", "allocated", "granted", "read_end")
    rows = []
    for request, load in loads.items():
        if "read_end" not in load:
            continue
        start = issued.get(load["ticket"], load["asked"])
        row = {"request": request, "ticket": load["ticket"], "total_ms": round(_ms(load["read_end"], start), 3)}
        if load["ticket"] in issued:
            row["ticket_to_load_ms"] = round(_ms(load["asked"], start), 3)
            row["p_request"] = issuers.get(load["ticket"], "")
        if load["queued_ms"] > 0:
            row["queued_ms"] = round(load["queued_ms"], 3)
        # In the order they happened (D may allocate before P's claim answer comes).
        reached = sorted((mark for mark in marks if mark in load), key=lambda mark: (load[mark], marks.index(mark)))
        for earlier, later in zip(reached, reached[1:]):
            row[f"{earlier}_to_{later}_ms"] = round(_ms(load[later], load[earlier]), 3)
        row["at_ns"] = {**({"issued": issued[load["ticket"]]} if load["ticket"] in issued else {}),
                        **{mark: load[mark] for mark in reached}}
        rows.append(row)
    rows.sort(key=lambda row: -row["total_ms"])
    return rows[:count]


def _summary(values: list[float]) -> dict:
    ordered = sorted(values)

    def pick(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"count": len(ordered), "p50_ms": pick(0.5), "p90_ms": pick(0.9), "max_ms": round(ordered[-1], 3)}


def engine_stream(header, records) -> tuple[str, LedgerConfig, list[ev.Event]]:
    """One engine's input to `timings` from its log (`core.log` header and records)."""
    return header.role, header.config, [r.event for r in records if r.event is not None]


def timings(logs: Iterable[tuple[str, LedgerConfig, list[ev.Event]]], slowest: int = 0) -> dict:
    """Phase latencies and counters of engines' event streams: `logs` is (role, config, events)
    per engine ("producer"/"prefill", "consumer"/"decode" or "both"). Returns {"phases": {name:
    summary}, "counters": {role: {name: n}}}; a phase no event reached is absent. With `slowest`,
    also {"slowest": [...]}: that many loads that ended last after P issued their ticket, each
    split into its phases (a tail in P50/P90 names its requests there)."""

    phases = _Phases()
    issued: dict[str, int] = {}
    issuers: dict[str, str] = {}  # ticket -> P's request
    requested: dict[str, int] = {}
    loads: dict[str, dict] = {}
    counters: dict[str, dict[str, int]] = {}
    for role, config, events in logs:
        events = list(events)
        if role in ("producer", "prefill", "both"):
            _prefill(events, phases, issued, issuers)
        if role in ("consumer", "decode", "both"):
            loads.update(_decode(events, phases, requested))
        ledger = Ledger(config)
        demoting: dict[str, list] = {}  # key -> its admission's [start, keys still demoting]
        history = ledger.history
        for event in events:
            if type(event) is ev.HistoryDemoted:
                block = history.blocks.get(event.key)
                # Only an answer the core takes ends a demotion (a late one for a key dropped and
                # demoted again meanwhile belongs to no batch); a failed one ends no batch.
                if block is not None and block.state == DEMOTING:
                    batch = demoting.pop(event.key, None)
                    if batch is not None and event.ok:
                        batch[1] -= 1
                        if not batch[1]:
                            phases.add("p.demotion", _ms(event.at_ns, batch[0]))
                ledger.apply(event)
                continue
            effects = ledger.apply(event)
            keys = [e.key for e in effects if type(e) is fx.DemoteHistory]
            if keys:
                batch = [event.at_ns, len(keys)]
                for key in keys:
                    demoting[key] = batch
        mine = counters.setdefault(role, {})
        for name, count in ledger.counters.items():
            if name.startswith(COUNTER_PREFIXES):
                mine[name] = mine.get(name, 0) + count
    for ticket, at in requested.items():
        if ticket in issued:
            phases.add("pd.ticket_to_load", _ms(at, issued[ticket]))
    result = {"phases": {name: _summary(phases[name]) for name in PHASES if phases.get(name)},
              "counters": {role: dict(sorted(c.items())) for role, c in counters.items()}}
    if slowest > 0:
        result["slowest"] = _slowest(loads, issued, issuers, slowest)
    return result


def format_timings(result: dict) -> str:
    lines = [f"{'phase':<24}{'count':>7}{'p50 ms':>10}{'p90 ms':>10}{'max ms':>10}"]
    for name, s in result["phases"].items():
        lines.append(f"{name:<24}{s['count']:>7}{s['p50_ms']:>10.2f}{s['p90_ms']:>10.2f}{s['max_ms']:>10.2f}")
    for role, counts in result["counters"].items():
        if counts:
            lines.append(f"{role}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    if result.get("slowest"):
        lines.append("slowest loads (P's ticket -> D's last read ended), ms:")
        for row in result["slowest"]:
            # (A dict of milliseconds, as the benchmark's `hops_ms`, lists its own parts.)
            parts = ", ".join(f"{k[:-3]} {v:.1f}" if isinstance(v, (int, float))
                              else ", ".join(f"{name} {ms:.1f}" for name, ms in v.items())
                              for k, v in row.items() if k.endswith("_ms") and k != "total_ms")
            lines.append(f"  {row['request']} (ticket {row['ticket'][:8]}): {row['total_ms']:.1f}: {parts}")
    return "\n".join(lines)


# The effects that say how a request's handoff, load or restore went, as the story tells them.
_OUTCOMES = {
    fx.LoadResolved: lambda e: "hit" if e.hit else f"miss: {e.reason}",
    fx.LoadFinished: lambda e: f"load ended: {e.reason}",
    fx.LeaseDone: lambda e: f"restore ended: {e.reason}",
    fx.ReplyRestore: lambda e: f"history holds {len(e.keys)} blocks",
    fx.FreeEngineBlocks: lambda e: "P's blocks returned",
}


def request_story(logs: Iterable[tuple[str, str, LedgerConfig, list[ev.Event]]], request: str) -> dict:
    """Everything the logs say about one request: `logs` is (engine, role, config, events) per
    engine, `request` an engine's request id (P's or D's). The handoff it took part in joins the
    two engines by ticket, so P's and D's sides come together (one host: one clock). Returns
    {"request", "tickets", "events": [(ms from the first, engine, event, what it said, outcomes)],
    "outcome": the last load's or restore's end}."""

    logs = [(engine, role, config, list(events)) for engine, role, config, events in logs]
    tickets: set[str] = set()
    leases: set[str] = set()
    for _engine, _role, _config, events in logs:
        for e in events:
            if getattr(e, "request", None) == request:
                if getattr(e, "ticket", ""):
                    tickets.add(e.ticket)
                if getattr(e, "lease", ""):
                    leases.add(e.lease)
    requests = {request}
    for _engine, _role, _config, events in logs:  # the other side's id for the same ticket
        for e in events:
            if getattr(e, "ticket", None) in tickets and getattr(e, "request", ""):
                requests.add(e.request)
    lines: list[tuple[int, str, str, str, list[str]]] = []
    outcome = ""
    for engine, _role, config, events in logs:
        ledger = Ledger(config)
        for e in events:
            effects = ledger.apply(e)
            if not (getattr(e, "request", None) in requests or getattr(e, "ticket", None) in tickets
                    or getattr(e, "lease", None) in leases):
                continue
            said = [_OUTCOMES[type(x)](x) for x in effects if type(x) in _OUTCOMES
                    and getattr(x, "request", request) in requests]
            for text in said:
                if text.startswith(("load ended", "restore ended", "miss")):
                    outcome = text
            lines.append((e.at_ns, engine, type(e).__name__, _what(e), said))
    lines.sort(key=lambda line: line[0])
    first = lines[0][0] if lines else 0
    return {"request": request, "requests": sorted(requests), "tickets": sorted(tickets),
            "events": [(round(_ms(at, first), 3), engine, name, what, said) for at, engine, name, what, said in lines],
            "outcome": outcome}


def _what(e: ev.Event) -> str:
    """The fields of an event worth a line (ids shortened, block lists counted)."""

    parts = []
    for name in getattr(type(e), "__struct_fields__", ()):
        if name == "at_ns":
            continue
        value = getattr(e, name)
        if isinstance(value, tuple):
            parts.append(f"{name}={len(value)}")
        elif isinstance(value, str) and len(value) > 16:
            parts.append(f"{name}={value[:8]}…")
        elif value not in ("", None, 0, False) or name in ("ok", "hit", "held", "in_pin"):
            parts.append(f"{name}={value}")
    return " ".join(parts)


def format_story(story: dict) -> str:
    lines = [f"request {story['request']} (ids {', '.join(story['requests'])}; tickets "
             f"{', '.join(t[:8] for t in story['tickets']) or 'none'})"]
    for at, engine, name, what, said in story["events"]:
        lines.append(f"{at:>10.3f} ms  {engine[:12]:<12} {name:<20} {what}" + (f"  -> {'; '.join(said)}" if said else ""))
    if not story["events"]:
        lines.append("no event of this request in these logs")
    elif story["outcome"]:
        lines.append(f"outcome: {story['outcome']}")
    return "\n".join(lines)
