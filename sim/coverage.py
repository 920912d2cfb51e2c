"""Transition coverage: which declared (state, trigger) pairs of each machine a run moved through.

Every book counts its moves when asked (`Ledger.track_moves`); the fuzzer hands all its ledgers one
tally per machine and reports, per machine, the pairs exercised out of those declared. A declared
pair that the code cannot take is listed in `UNREACHABLE` with the reason, so the goal stays "all
of them" and an unexercised pair is either listed here or a gap in the simulator.
"""

from __future__ import annotations

from collections import Counter

import msgspec

from ..core import history, lease, load, session, ticket

SPECS = {spec.name: spec for spec in (ticket.SPEC, load.SPEC, lease.SPEC, session.SPEC, history.SPEC)}

# (machine, state, trigger) -> why no handler ever makes that move.
UNREACHABLE: dict[tuple[str, str, str], str] = {
    (history.SPEC.name, history.EVICTED, "seen_again"):
        "an evicted block's record leaves the store and its key goes on probation; a key admitted "
        "again is a new record that starts in PROBATION, so no record moves out of EVICTED",
}


class MachineCoverage(msgspec.Struct):
    declared: int  # (state, trigger) pairs in the declaration
    exercised: int  # of those, pairs some move took
    unreachable: int  # of those not exercised, pairs listed in UNREACHABLE
    missing: list[str]  # "STATE -trigger->" pairs neither exercised nor listed unreachable
    moves_declared: int  # (state, trigger, dest) moves in the declaration
    moves_exercised: int


class Coverage:
    """One tally of moves per machine, shared by every ledger it watches."""

    def __init__(self) -> None:
        self.moves: dict[str, Counter] = {name: Counter() for name in SPECS}

    def watch(self, ledger) -> None:
        ledger.track_moves(into=self.moves)

    def exercised(self, machine: str) -> set[tuple[str, str]]:
        return {(source, trigger) for source, trigger, _ in self.moves[machine]}

    def report(self) -> dict[str, MachineCoverage]:
        out = {}
        for name, spec in SPECS.items():
            declared = set(spec.table)
            exercised = self.exercised(name) & declared
            unreachable = {pair for pair in declared - exercised if (name, *pair) in UNREACHABLE}
            missing = sorted(declared - exercised - unreachable)
            moves = {(s, t, d) for (s, t), dests in spec.table.items() for d in dests}
            out[name] = MachineCoverage(
                declared=len(declared), exercised=len(exercised), unreachable=len(unreachable),
                missing=[f"{state} -{trigger}->" for state, trigger in missing],
                moves_declared=len(moves), moves_exercised=len(moves & set(self.moves[name])))
        return out
