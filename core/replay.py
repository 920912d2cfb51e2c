"""Replay: re-apply a log to a fresh ledger, check every invariant after every event, and find
the first event that breaks one or diverges from a hash the writer recorded."""

from __future__ import annotations

from collections.abc import Callable, Iterable

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
    # With periodic checks: the last event checked clean before the first violation was seen
    # (the first broken event lies after it; replay again with exact_after to name it).
    last_clean_seq: int = 0


def replay(
    header: LogHeader,
    records: Iterable[Record],
    ledger_factory: Callable[[LedgerConfig], Ledger] = Ledger,
    on_step: Callable[[Step], None] | None = None,
    check_leaks: bool = False,
    check_every: int = 1,
    exact_after: int | None = None,
) -> ReplayResult:
    """Re-apply `records` (any iterable: a list, or a stream). The ledger's invariants (a walk of
    every open record) are checked after every event when `check_every` is 1, else every
    `check_every` events, after the last one, and after every event past seq `exact_after`: a
    long log replays in time linear in its records, and a second pass with `exact_after` set to
    `last_clean_seq` names the first broken event. The auditor watches every event."""

    ledger = ledger_factory(header.config)
    auditor = Auditor(ledger.config.reader_silence_ns)
    compare_hashes = header.hash_version == STATE_HASH_VERSION
    events = violating = 0
    first_violation = first_divergence = None
    last_clean = 0
    checked_last = True
    for record in records:
        effects: list[Effect] = []
        violations: list[str] = []
        if record.event is not None:
            events += 1
            effects = ledger.apply(record.event)
            violations = auditor.observe(record.seq, record.event, effects)
            checked_last = (check_every <= 1 or events % check_every == 0
                            or (exact_after is not None and record.seq > exact_after))
            if checked_last:
                violations = ledger.check_invariants() + violations + auditor.cross_check(record.seq, ledger)
                if not violations and first_violation is None:
                    last_clean = record.seq
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
    if not checked_last:  # the end is always checked
        violations = ledger.check_invariants() + auditor.cross_check(-1, ledger)
        if violations:
            violating += 1
            if first_violation is None:
                first_violation = Step(-1, None, [], violations)
    return ReplayResult(
        events=events,
        state_hash=ledger.state_hash(),
        violating_events=violating,
        first_violation=first_violation,
        first_divergence=first_divergence,
        leaks=auditor.leaks() if check_leaks else [],
        last_clean_seq=last_clean,
    )
