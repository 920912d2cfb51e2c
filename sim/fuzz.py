"""`kvbaton fuzz`: many seeded swarm sequences, a per-fault census, transition coverage per machine,
and shrunk failing logs."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable

import msgspec

from ..core.events import Event, Tick
from ..core.ledger import Ledger, LedgerConfig
from ..core.log import LogHeader, LogWriter, Record
from ..core.replay import replay
from .coverage import Coverage, MachineCoverage
from .swarm import FAULTS, Swarm


class FuzzReport(msgspec.Struct):
    sequences: int = 0
    events: int = 0
    violations: int = 0  # sequences with an invariant or auditor violation
    leaks: int = 0  # sequences that left something open after the drain
    faults: dict[str, int] = msgspec.field(default_factory=dict)
    failures: list[dict] = msgspec.field(default_factory=list)  # seed, node, first lines, log path
    # Per machine: declared (state, trigger) pairs, how many the run moved through, what is missing.
    coverage: dict[str, MachineCoverage] = msgspec.field(default_factory=dict)


def _records(events: list[Event]) -> list[Record]:
    return [Record(i + 1, event) for i, event in enumerate(events)]


def still_fails(events: list[Event], config: LedgerConfig,
                ledger_factory: Callable[[LedgerConfig], Ledger]) -> bool:
    """Does replaying these events (to one ledger) break an invariant or the auditor?"""

    result = replay(LogHeader(config=config), _records(events), ledger_factory)
    return result.first_violation is not None


def shrink(events: list[Event], config: LedgerConfig,
           ledger_factory: Callable[[LedgerConfig], Ledger], budget: int = 4000) -> list[Event]:
    """Delta debugging (ddmin): the smallest sublist that still fails, within `budget` replays."""

    if not still_fails(events, config, ledger_factory):
        return events
    current = list(events)
    granularity = 2
    tries = 0
    while len(current) >= 2 and tries < budget:
        chunk = max(1, len(current) // granularity)
        reduced = False
        for start in range(0, len(current), chunk):
            candidate = current[:start] + current[start + chunk:]
            tries += 1
            if candidate and still_fails(candidate, config, ledger_factory):
                current = candidate
                granularity = max(granularity - 1, 2)
                reduced = True
                break
            if tries >= budget:
                break
        if not reduced:
            if chunk == 1:
                break
            granularity = min(len(current), granularity * 2)
    return current


def write_log(path: str, events: list[Event], config: LedgerConfig, engine: str,
              ledger_factory: Callable[[LedgerConfig], Ledger] = Ledger, hash_every: int = 1) -> None:
    """Write events as a log, with the state hash the given ledger reaches after each one."""

    ledger = ledger_factory(config)
    writer = LogWriter.open(path, LogHeader(engine=engine, role="fuzz", config=config, hash_every=hash_every))
    for event in events:
        ledger.apply(event)
        writer.append(event, ledger)
    writer.close(ledger)


def run_fuzz(seed: int = 1, sequences: int = 1000, steps: int = 300, out: str | None = None,
             ledger_factory: Callable[[LedgerConfig], Ledger] = Ledger,
             progress: Callable[[int], None] | None = None, stop_after_failures: int = 1,
             shrink_failures: bool = True) -> FuzzReport:
    report = FuzzReport()
    faults: Counter = Counter()
    coverage = Coverage()
    for index in range(sequences):
        sequence_seed = seed * 1_000_003 + index
        swarm = Swarm(sequence_seed, steps=steps, ledger_factory=ledger_factory)
        for node in swarm.nodes.values():
            coverage.watch(node.ledger)
        result = swarm.run()
        report.sequences += 1
        report.events += result.events
        faults.update(result.faults)
        failed = bool(result.violations) or bool(result.leaks)
        report.violations += bool(result.violations)
        report.leaks += bool(result.leaks)
        if failed:
            entry = {"seed": sequence_seed, "node": result.failing_node,
                     "first": (result.violations or result.leaks)[:3]}
            if out is not None and result.failing_log:
                os.makedirs(out, exist_ok=True)
                events = result.failing_log
                if shrink_failures and result.violations:
                    events = shrink(events, result.config, ledger_factory)
                path = os.path.join(out, f"fuzz-seed{sequence_seed}-{result.failing_node}.kvlog")
                write_log(path, events, result.config, result.failing_node, ledger_factory)
                entry["log"] = path
                entry["events"] = len(events)
            report.failures.append(entry)
            if len(report.failures) >= stop_after_failures:
                break
        if progress is not None:
            progress(1)
    report.faults = {name: faults.get(name, 0) for name in FAULTS}
    report.faults["clock_jumped"] = faults.get("clock_jumped", 0)
    report.coverage = coverage.report()
    return report


def drain_tick(events: list[Event]) -> list[Event]:
    """Append a tick far past every deadline (used when checking a log for leaks)."""

    last = max((e.at_ns for e in events), default=0)
    return events + [Tick(at_ns=last + 10**15)]
