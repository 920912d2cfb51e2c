"""Hypothesis over P's history policy alone: retentions, copy results, demotions, restores,
leases, and agent sessions (turns kept, prefetches and their promotions, closes, expiry) in any order. After every step: prefix closure, budgets, pins equal open leases, at most
`retention_writers_max` writers (the ledger's invariants) and the auditor's books. Teardown ends everything in flight and ticks
past every deadline: no lease left open, no block pinned, budgets still respected."""

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvbaton.core import effects as fx
from kvbaton.core import events as ev
from kvbaton.core.audit import Auditor
from kvbaton.core.ledger import Ledger, LedgerConfig

BLOCK = 100
DOCS = ["a", "b", "c", "d"]


class HistoryPolicy(RuleBasedStateMachine):
    @initialize(gpu=st.integers(0, 6), cpu=st.integers(0, 8), candidate=st.integers(1, 8),
                writers=st.sampled_from([1, 2, 4]), session_deadline=st.sampled_from([0, 60]))
    def setup(self, gpu, cpu, candidate, writers, session_deadline):
        self.ledger = Ledger(LedgerConfig(block_bytes=BLOCK, gpu_history_bytes=gpu * BLOCK,
                                          cpu_history_bytes=cpu * BLOCK, candidate_bytes_max=candidate * BLOCK,
                                          history_lease_ns=50, retention_deadline_ns=20, probation_max=8,
                                          retention_writers_max=writers,
                                          session_retention_deadline_ns=session_deadline))
        self.auditor = Auditor()
        self.now = 0
        self.seq = 0
        self.next_id = 0
        self.retaining: list[str] = []
        self.demoting: list[str] = []
        self.promoting: list[str] = []
        self.leases: dict[str, str] = {}  # lease -> state as the shell sees it
        self.hits_expected = 0
        self.violations: list[str] = []

    def apply(self, event):
        self.seq += 1
        effects = self.ledger.apply(event)
        self.violations += self.ledger.check_invariants() + self.auditor.observe(self.seq, event, effects)
        self.violations += self.auditor.cross_check(self.seq, self.ledger)
        for effect in effects:
            if isinstance(effect, fx.StageHistory):
                self.retaining.append(effect.ticket)
            elif isinstance(effect, fx.DemoteHistory):
                self.demoting.append(effect.key)
            elif isinstance(effect, fx.PromoteHistory):
                self.promoting.extend(effect.keys)
            elif isinstance(effect, fx.ReplyRestore) and effect.keys:
                self.leases[effect.lease] = "reserved"
            elif isinstance(effect, fx.LeaseDone):
                self.leases.pop(effect.lease, None)
        return effects

    def tick(self, dt=1):
        self.now += dt
        self.apply(ev.Tick(self.now))

    @rule(doc=st.sampled_from(DOCS), length=st.integers(1, 6), observe=st.booleans())
    def retain_a_prefix(self, doc, length, observe):
        keys = tuple(f"{doc}{i}" for i in range(length))
        if observe:
            self.apply(ev.HistoryObserved(self.now, keys))
        self.next_id += 1
        ticket = f"t{self.next_id}"
        blocks = tuple(range(self.next_id * 10, self.next_id * 10 + length))
        self.apply(ev.TicketIssued(self.now, ticket, "r" + ticket, blocks, keys))
        self.apply(ev.ClaimRequested(self.now, ticket, "D", 1))
        self.apply(ev.ReleaseRequested(self.now, ticket, "D", 1))

    @precondition(lambda self: self.retaining)
    @rule(ok=st.booleans(), index=st.integers(0, 5))
    def copies_finish(self, ok, index):
        ticket = self.retaining.pop(index % len(self.retaining))
        self.apply(ev.HistoryPublished(self.now, ticket, ok))

    @precondition(lambda self: self.demoting)
    @rule(ok=st.booleans(), index=st.integers(0, 5))
    def demotion_finishes(self, ok, index):
        key = self.demoting.pop(index % len(self.demoting))
        self.apply(ev.HistoryDemoted(self.now, key, ok))

    @rule(doc=st.sampled_from(DOCS), length=st.integers(1, 6), keep=st.sampled_from([0, 10, 40, 200]))
    def session_turn(self, doc, length, keep):
        self.apply(ev.SessionKept(self.now, f"s-{doc}", tuple(f"{doc}{i}" for i in range(length)), keep))

    @rule(doc=st.sampled_from(DOCS + ["nobody"]), what=st.sampled_from(["prefetch", "keep", "close"]))
    def session_prefetch_keep_or_close(self, doc, what):
        if what == "close":
            self.apply(ev.SessionClosed(self.now, f"s-{doc}"))
        else:  # "keep": a turn the decode engine served alone refreshes the keep time only
            self.apply(ev.SessionPrefetchRequested(self.now, f"s-{doc}", promote=what == "prefetch"))

    @precondition(lambda self: self.promoting)
    @rule(ok=st.booleans(), index=st.integers(0, 5))
    def promotion_finishes(self, ok, index):
        key = self.promoting.pop(index % len(self.promoting))
        self.apply(ev.HistoryPromoted(self.now, key, ok))

    @rule(doc=st.sampled_from(DOCS), length=st.integers(1, 6))
    def restore_requested(self, doc, length):
        self.next_id += 1
        self.apply(ev.RestoreRequested(self.now, f"L{self.next_id}", f"q{self.next_id}", 0,
                                       tuple(f"{doc}{i}" for i in range(length))))

    @precondition(lambda self: self.leases)
    @rule(index=st.integers(0, 5), action=st.sampled_from(["allocate", "read", "finish_ok", "finish_bad", "release"]))
    def lease_moves(self, index, action):
        lease = sorted(self.leases)[index % len(self.leases)]
        record = self.ledger.leases.leases[lease]
        if action == "allocate":
            self.apply(ev.LeaseAllocated(self.now, lease, tuple(range(1000, 1000 + max(1, len(record.keys) - 1)))))
        elif action == "read":
            self.apply(ev.LeaseReadStarted(self.now, lease))
        elif action in ("finish_ok", "finish_bad"):
            before = sum(v for k, v in self.ledger.counters.items() if k.startswith("restores.hits."))
            reading = record.state == "READING"
            self.apply(ev.LeaseReadFinished(self.now, lease, action == "finish_ok"))
            after = sum(v for k, v in self.ledger.counters.items() if k.startswith("restores.hits."))
            expected = len(record.keys) if (reading and action == "finish_ok") else 0
            if after - before != expected:
                self.violations.append(f"hits counted {after - before}, expected {expected}")
        else:
            self.apply(ev.LeaseReleased(self.now, lease, record.request, record.epoch))

    @rule(dt=st.sampled_from([1, 25, 60]))
    def time_passes(self, dt):
        self.tick(dt)

    @invariant()
    def nothing_broken(self):
        assert not self.violations, self.violations[:3]

    def teardown(self):
        while self.retaining:
            self.apply(ev.HistoryPublished(self.now, self.retaining.pop(), True))
        while self.demoting or self.promoting:
            if self.demoting:
                self.apply(ev.HistoryDemoted(self.now, self.demoting.pop(), True))
            else:
                self.apply(ev.HistoryPromoted(self.now, self.promoting.pop(), True))
        for lease in list(self.leases):
            if self.ledger.leases.leases[lease].state == "READING":
                self.apply(ev.LeaseReadFinished(self.now, lease, True))
        self.tick(10**9)
        assert not self.violations, self.violations[:3]
        assert self.ledger.open_counts() == {"tickets": 0, "loads": 0, "leases": 0, "sessions": 0}
        assert all(block.pins == 0 for block in self.ledger.history.blocks.values())
        assert self.ledger.history.kept == {}  # every session expired: nothing is kept
        assert not any(block.state == "PROMOTING" for block in self.ledger.history.blocks.values())
        assert self.auditor.leaks() == []


HistoryPolicy.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVBATON_STATEFUL_EXAMPLES", "150")), stateful_step_count=50,
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestHistoryPolicy = HistoryPolicy.TestCase
