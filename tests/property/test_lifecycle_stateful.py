"""Hypothesis drives P and D ledgers through every fault kind, choosing the order of every message.

Invariants (each ledger's own, the outside auditor's and the engine block-pool model's) are
checked after every step; teardown heals and drains, then nothing may be open or held. A failure
is saved as event logs that `kvbaton replay` reproduces (path printed in the failure).
"""

import os
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvbaton.core.events import AbandonRequested, RequestAborted, RequestPreempted
from kvbaton.core.ledger import LedgerConfig
from kvbaton.sim.fuzz import write_log
from kvbaton.sim.stepped import SteppedSwarm
from kvbaton.sim.swarm import MS, P_NAME

EFFECT_FAULTS = [
    "preempt_after_claim", "preempt_after_alloc", "abort_before_alloc", "abort_while_loading",
    "router_cancel_before_claim", "router_cancel_after_claim", "router_retry", "transport_error",
    "duplicate_message", "copy_failure", "lease_expiry", "restore_abort", "claim_after_expiry",
    "expiry_between_reads", "expiry_while_reading",
]


def save_failure(swarm: SteppedSwarm) -> str:
    folder = tempfile.mkdtemp(prefix="kvbaton-stateful-")
    for node in swarm.nodes.values():
        write_log(os.path.join(folder, f"{node.name}.kvlog"), node.log, swarm.config, node.name)
    return folder


class PairLifecycle(RuleBasedStateMachine):
    @initialize(
        gpu_blocks=st.sampled_from([0, 2, 6]),
        cpu_blocks=st.sampled_from([0, 2, 8]),
        ttl_ms=st.sampled_from([50, 400]),
    )
    def setup(self, gpu_blocks, cpu_blocks, ttl_ms):
        config = LedgerConfig(
            unclaimed_ttl_ns=ttl_ms * MS, unclaimed_grace_ns=ttl_ms * MS // 2, claim_lease_ns=2 * ttl_ms * MS,
            claim_wait_ns=ttl_ms * MS,
            read_grant_wait_ns=ttl_ms * MS, history_lease_ns=ttl_ms * MS, retention_deadline_ns=10 * MS,
            gpu_history_bytes=gpu_blocks * 1000, cpu_history_bytes=cpu_blocks * 1000, block_bytes=1000,
            candidate_bytes_max=5000, probation_max=16,
        )
        self.swarm = SteppedSwarm(config)

    @rule()
    def new_request(self):
        self.swarm.new_request()

    @precondition(lambda self: self.swarm.pending)
    @rule(index=st.integers(min_value=0, max_value=1000))
    def run_pending(self, index):
        self.swarm.run_pending(index)

    @precondition(lambda self: self.swarm.pending)
    @rule(index=st.integers(min_value=0, max_value=1000))
    def duplicate_pending(self, index):
        pending = self.swarm.pending
        pending.append(pending[index % len(pending)])

    @rule(fault=st.sampled_from(EFFECT_FAULTS))
    def arm_fault(self, fault):
        self.swarm.armed.add(fault)

    @rule(ms=st.sampled_from([1, 30, 200, 1000]))
    def time_passes(self, ms):
        self.swarm.advance(ms)

    @rule()
    def heartbeat(self):
        self.swarm.heartbeat()

    @precondition(lambda self: self.swarm.sent)
    @rule(index=st.integers(min_value=0, max_value=1000))
    def stale_message(self, index):
        to, event = self.swarm.sent[index % len(self.swarm.sent)]
        fields = {f: getattr(event, f) for f in event.__struct_fields__ if f != "at_ns"}
        self.swarm.deliver(to, type(event), fields)

    @rule(index=st.integers(min_value=0, max_value=7), preempt=st.booleans())
    def cancel_load(self, index, preempt):
        swarm = self.swarm
        for d in swarm.ds.values():
            loads = sorted(swarm.nodes[d.name].ledger.loads.loads)
            if loads and d.alive:
                request = loads[index % len(loads)]
                kind = RequestPreempted if preempt else RequestAborted
                swarm.local(d, kind, {"request": request})
                return

    @rule(index=st.integers(min_value=0, max_value=7))
    def router_abandons(self, index):
        tickets = sorted(self.swarm.p.ledger.tickets.tickets)
        if tickets:
            self.swarm.send(P_NAME, AbandonRequested, ticket=tickets[index % len(tickets)])

    @rule()
    def decode_dies(self):
        alive = [d for d in self.swarm.ds.values() if d.alive]
        if len(alive) > 1:
            self.swarm.result.faults["decode_death"] += 1
            self.swarm.kill(alive[0])

    @invariant()
    def nothing_broken(self):
        if self.swarm.result.violations:
            folder = save_failure(self.swarm)
            raise AssertionError(f"{self.swarm.result.violations[:3]}; logs in {folder}")

    def teardown(self):
        swarm = self.swarm
        swarm.drain()
        problems = swarm.result.violations + swarm.result.leaks
        if problems:
            folder = save_failure(swarm)
            raise AssertionError(f"after drain: {problems[:3]}; logs in {folder}")


PairLifecycle.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVBATON_STATEFUL_EXAMPLES", "150")),
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPairLifecycle = PairLifecycle.TestCase
