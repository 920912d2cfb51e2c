"""Replay: re-apply a log to a fresh ledger, check every invariant after every event, and find
the first event that breaks one or diverges from a hash the writer recorded."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from .audit import Auditor
from .effects import Effect
from .events import Event
from .ledger import STATE_HASH_VERSION, Ledger, LedgerConfig
from .log import LogHeader, Record


class Step(msgspec.Struct):
    seq: int
    event: Event | None
    effects: list[Effect]
    violations: list[str]
    diverged: str = ""  # "recorded <hash>, replayed <hash>" when the hash disagrees


class ReplayResult(msgspec.Struct):
    events: int
    state_hash: str
    violating_events: int
    first_violation: Step | None
    first_divergence: Step | None
    leaks: list[str]


def replay(
    header: LogHeader,
    records: list[Record],
    ledger_factory: Callable[[LedgerConfig], Ledger] = Ledger,
    on_step: Callable[[Step], None] | None = None,
    check_leaks: bool = False,
) -> ReplayResult:
    ledger = ledger_factory(header.config)
    auditor = Auditor()
    compare_hashes = header.hash_version == STATE_HASH_VERSION
    events = violating = 0
    first_violation = first_divergence = None
    for record in records:
        effects: list[Effect] = []
        violations: list[str] = []
        if record.event is not None:
            events += 1
            effects = ledger.apply(record.event)
            violations = ledger.check_invariants() + auditor.observe(record.seq, record.event, effects)
            violations += auditor.cross_check(record.seq, ledger)
        step = Step(record.seq, record.event, effects, violations)
        if record.state_hash is not None and compare_hashes:
            replayed = ledger.state_hash()
            if replayed != record.state_hash:
                step.diverged = f"recorded {record.state_hash}, replayed {replayed}"
                if first_divergence is None:
                    first_divergence = step
        if violations:
            violating += 1
            if first_violation is None:
                first_violation = step
        if on_step is not None:
            on_step(step)
    return ReplayResult(
        events=events,
        state_hash=ledger.state_hash(),
        violating_events=violating,
        first_violation=first_violation,
        first_divergence=first_divergence,
        leaks=auditor.leaks() if check_leaks else [],
    )
