"""A swarm whose scheduling is chosen from outside, one pending action at a time.

Hypothesis drives it: every pending message, copy or scheduler decision waits in a list, and a
rule picks which one runs next (so any reordering can happen), while other rules inject faults.
The same shell model as the seeded simulator checks every event.
"""

from __future__ import annotations

from ..core.ledger import Ledger, LedgerConfig
from .swarm import MS, Swarm


class SteppedSwarm(Swarm):
    def __init__(self, config: LedgerConfig, ledger_factory=Ledger) -> None:
        super().__init__(seed=0, steps=0, ledger_factory=ledger_factory)
        # Rebuild the ledgers with the chosen config (the base class drew one from its seed).
        self.config = self.result.config = config
        for node in self.nodes.values():
            node.ledger = ledger_factory(config)
        self.profile = {name: 0.0 for name in self.profile}
        self.armed: set[str] = set()
        self.pending: list = []
        self.requests_left = 10**9

    def fault(self, name: str) -> bool:
        if self.draining or name not in self.armed:
            return False
        self.armed.discard(name)
        self.result.faults[name] += 1
        return True

    def at(self, delay_ns: int, action, *args) -> None:
        if self.draining or action not in (self.ticks, self.heartbeat, self.chaos):
            self.pending.append((action, args))

    def delay(self, low_ms: float = 0.1, high_ms: float = 20) -> int:
        return 0

    def run_pending(self, index: int) -> None:
        if self.pending:
            action, args = self.pending.pop(index % len(self.pending))
            action(*args)

    def advance(self, ms: int) -> None:
        self.now += ms * MS
        self.ticks_once()

    def ticks_once(self) -> None:
        from ..core.events import Tick

        for node in self.nodes.values():
            self.apply(node, Tick(at_ns=self.now))

    def drain(self) -> None:
        self.draining = True
        for _round in range(50):
            guard = 0
            while self.pending and not self.result.violations and guard < 100_000:
                self.run_pending(0)
                guard += 1
            if self.result.violations:
                return
            self.now += 10**15
            self.ticks_once()
            if not self.pending:
                break
        self.check_quiescent()
