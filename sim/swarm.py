"""The seeded swarm simulator: P and D ledgers, a router and a network, under injected faults.

Each sequence draws its own fault profile from its seed (swarm testing: some sequences are nearly
clean, some brutal), runs a random workload of handoffs and history restores, checks every
ledger's invariants and an outside auditor after every event, and ends with a drain: faults stop,
every message is delivered, every copy completes, time runs past every deadline, and then nothing
may be open and every engine block must be back in its pool.

The simulator plays the shell: it turns effects into messages, copies and scheduler decisions,
exactly as the connector and sidecar do, and it keeps a model of each engine's block pool, so a
read of blocks that were returned, or a double free, is caught even if a ledger looks consistent.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Callable

import msgspec

from ..core import effects as fx
from ..core import events as ev
from ..core import load as loads
from ..core.audit import Auditor
from ..core.common import NEVER
from ..core.machine import InternalError
from ..core.ledger import SECOND_NS, Ledger, LedgerConfig

FAULTS = (
    "claim_after_expiry",
    "expiry_while_reading",
    "expiry_between_reads",
    "preempt_after_claim",
    "preempt_after_alloc",
    "abort_before_alloc",
    "abort_while_loading",
    "router_cancel_before_claim",
    "router_cancel_after_claim",
    "router_retry",
    "transport_error",
    "decode_death",
    "duplicate_message",
    "reordered_message",
    "stale_message",
    "history_tier_full",
    "copy_failure",
    "clock_jump",
    "lease_expiry",
    "restore_abort",
    "abort_before_claim",
    "lost_read_end",
    "allocate_before_grant",
    "mismatched_grant",
    "slow_read",
)

MS = 1_000_000
P_NAME = "P0"
D_NAMES = ("D0", "D1")

# Messages between engines: only these can be duplicated, reordered or replayed late.
MESSAGE_TYPES = (
    ev.ClaimRequested, ev.HeartbeatReceived, ev.ReadStarted, ev.ReadFinished, ev.ReleaseRequested,
    ev.AbandonRequested, ev.ClaimGranted, ev.ClaimRefused, ev.ReadGranted, ev.ReadRefused,
    ev.ReadEndAnswered,
)


def sim_config(rng: random.Random, tier_full: bool) -> LedgerConfig:
    """Short timeouts so expiries happen inside a sequence; tiny tiers when `tier_full`."""

    block_bytes = 1000
    gpu_blocks = rng.choice([0, 2, 4]) if tier_full else rng.choice([0, 8, 32])
    cpu_blocks = rng.choice([0, 2, 3]) if tier_full else rng.choice([0, 16, 64])
    claim_wait_ns = rng.choice([100, 400, 1500]) * MS
    read_grant_wait_ns = rng.choice([100, 400, 1500]) * MS
    config = LedgerConfig(
        unclaimed_ttl_ns=rng.choice([200, 500, 2000]) * MS,
        claim_lease_ns=rng.choice([300, 1000, 4000]) * MS,
        claim_wait_ns=claim_wait_ns,
        read_grant_wait_ns=read_grant_wait_ns,
        # Short, so sequences prune closed records and late answers meet records already gone
        # (derived, not drawn: the random stream of older seeds stays the same).
        closed_retention_ns=min(claim_wait_ns, read_grant_wait_ns),
        # Far longer than a clock jump (the largest timeout plus 1 ms, a few in a row at most)
        # plus a heartbeat interval: a live reader is always heard in time, and a dead one's reads
        # end by this rule (at the latest in the drain).
        reader_silence_ns=60_000 * MS,
        history_lease_ns=rng.choice([50, 300, 1000]) * MS,
        retention_deadline_ns=rng.choice([5, 20, 100]) * MS,
        gpu_history_bytes=gpu_blocks * block_bytes,
        cpu_history_bytes=cpu_blocks * block_bytes,
        block_bytes=block_bytes,
        candidate_bytes_max=rng.choice([3, 6, 100]) * block_bytes,
        probation_max=rng.choice([4, 64]),
        retention_writers_max=rng.choice([1, 2, 4]),
    )
    # A grace of half the TTL, derived (not drawn: older seeds' random streams stay the same): new
    # tickets nobody claims or heartbeats close early. Sessions' bounds are derived too, small
    # enough that their trims, refusals and clamps happen, and their retentions' longer deadline.
    return msgspec.structs.replace(
        config, unclaimed_grace_ns=config.unclaimed_ttl_ns // 2,
        session_keep_max_ns=config.history_lease_ns * 3, session_bytes_max=4 * block_bytes,
        sessions_bytes_max=6 * block_bytes, sessions_max=3,
        session_retention_deadline_ns=config.retention_deadline_ns * 4)



class Node:
    """One engine: its ledger, its auditor, its event log (kept in memory) and its block pool."""

    def __init__(self, name: str, ledger: Ledger, pool_blocks: int) -> None:
        self.name = name
        self.ledger = ledger
        ledger.make_strict()  # a machine's bug fails the sequence at the event that caused it
        self.auditor = Auditor(ledger.config.reader_silence_ns)
        self.log: list[ev.Event] = []
        self.alive = True
        self.free = set(range(pool_blocks))
        self.owner: dict[int, str] = {}  # engine block -> request holding it

    def allocate(self, request: str, count: int) -> tuple[int, ...] | None:
        if count > len(self.free):
            return None
        blocks = tuple(sorted(self.free)[:count])
        for block in blocks:
            self.free.discard(block)
            self.owner[block] = request
        return blocks


class SequenceResult:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.events = 0
        self.violations: list[str] = []
        self.leaks: list[str] = []
        self.faults: Counter = Counter()
        self.failing_node: str = ""
        self.failing_log: list[ev.Event] = []
        self.config: LedgerConfig | None = None


class Swarm:
    """One sequence. `run()` returns a `SequenceResult`."""

    def __init__(self, seed: int, steps: int = 200,
                 ledger_factory: Callable[[LedgerConfig], Ledger] = Ledger) -> None:
        self.rng = rng = random.Random(seed)
        self.result = SequenceResult(seed)
        # Swarm profile: each fault is either off or on with its own probability.
        self.profile = {f: (rng.uniform(0.02, 0.35) if rng.random() < 0.6 else 0.0) for f in FAULTS}
        config = sim_config(rng, tier_full=self.profile["history_tier_full"] > 0)
        # Agent sessions draw from a stream of their own: older seeds' other draws stay the same.
        self.session_rng = random.Random(seed * 7919 + 1)
        if config.gpu_history_bytes and self.session_rng.random() < 0.3:
            # A GPU tier smaller than what sessions keep, over a roomy CPU tier: kept blocks go
            # down a tier and prefetches bring them back.
            config = msgspec.structs.replace(config, gpu_history_bytes=2 * config.block_bytes,
                                             cpu_history_bytes=max(config.cpu_history_bytes, 16 * config.block_bytes))
        if self.profile["history_tier_full"] > 0:
            self.result.faults["history_tier_full"] += 1
        self.config = self.result.config = config
        self.steps = steps
        self.now = 0
        self.agenda: list = []
        self.order = 0
        self.draining = False
        self.p = Node(P_NAME, ledger_factory(config), pool_blocks=48)
        self.ds = {name: Node(name, ledger_factory(config), pool_blocks=24) for name in D_NAMES}
        self.nodes = {P_NAME: self.p, **self.ds}
        self.sent: list[tuple[str, ev.Event]] = []
        self.claims: dict[tuple[str, str, int], str] = {}  # (D, ticket, epoch) -> request
        self.reads: dict[tuple[str, str], str] = {}  # (D, read) -> request
        self.read_ticket: dict[tuple[str, str], tuple[str, str]] = {}  # (D, read) -> (ticket, P request)
        self.ticket_request: dict[str, str] = {}
        self.ticket_blocks: dict[str, tuple[int, ...]] = {}
        self.read_epoch: dict[tuple[str, str], int] = {}
        self.read_asked: dict[tuple[str, str], int] = {}  # (D, read) -> when D asked P for it
        self.confirming: dict[tuple[str, str], str] = {}  # (D, read) -> request awaiting P's word
        self.tainted: set[tuple[str, str]] = set()  # (D, request): a read ended after P let go
        self.sync_loads: set[tuple[str, str]] = set()  # (D, request): allocated as a synchronous load
        self.restore_blocks: dict[str, tuple[int, ...]] = {}
        self.lease_requests: dict[str, str] = {}
        self.next_id = 0
        self.requests_left = rng.randint(3, 14)
        self.docs = [f"d{i}" for i in range(rng.randint(1, 4))]

    # -- plumbing --------------------------------------------------------------------------------

    def fault(self, name: str) -> bool:
        if self.draining:
            return False
        hit = self.rng.random() < self.profile[name]
        if hit:
            self.result.faults[name] += 1
        return hit

    def at(self, delay_ns: int, action, *args) -> None:
        self.order += 1
        heapq.heappush(self.agenda, (self.now + max(0, delay_ns), self.order, action, args))

    def delay(self, low_ms: float = 0.1, high_ms: float = 20) -> int:
        return int(self.rng.uniform(low_ms, high_ms) * MS)

    def send(self, to: str, event_type, **fields) -> None:
        """Network delivery: maybe duplicated, reordered, replayed later."""

        delay = self.delay(0.05, 5)
        if self.fault("reordered_message"):
            delay += self.delay(5, 200)
        self.at(delay, self.deliver, to, event_type, fields)
        if self.fault("duplicate_message"):
            self.at(delay + self.delay(0, 10), self.deliver, to, event_type, fields)

    def send_later(self, to: str, event_type, fields: dict) -> None:
        self.send(to, event_type, **fields)

    def deliver(self, to: str, event_type, fields: dict) -> None:
        if not self.nodes[to].alive:
            return
        event = event_type(at_ns=self.now, **fields)
        self.sent.append((to, event))
        node = self.nodes[to]
        self.apply(node, event)
        if node is not self.p and event_type in (ev.ClaimGranted, ev.ReadGranted) and node.alive \
                and fields["request"] not in node.ledger.loads.loads:
            # D's shell (control/sidecar.py does the same): a grant for a load the ledger pruned
            # is undone, or P would hold the ticket (a read pinned for good).
            if event_type is ev.ClaimGranted:
                self.send(P_NAME, ev.ReleaseRequested, ticket=fields["ticket"], claimer=to, epoch=fields["epoch"])
            else:
                ticket, _ = self.read_ticket.get((to, fields["read"]), ("", ""))
                epoch = self.read_epoch.get((to, fields["read"]), 0)
                self.send(P_NAME, ev.ReadFinished, ticket=ticket, read=fields["read"], ok=False, claimer=to,
                          epoch=epoch)
                self.send(P_NAME, ev.ReleaseRequested, ticket=ticket, claimer=to, epoch=epoch)

    def apply(self, node: Node, event: ev.Event) -> None:
        if not node.alive:
            return
        node.log.append(event)
        try:
            effects = node.ledger.apply(event)
        except InternalError as exc:
            self.fail(node, [f"{node.name} event {len(node.log)}: {exc}"])
            return
        self.result.events += 1
        seq = len(node.log)
        found = node.ledger.check_invariants() + node.auditor.observe(seq, event, effects)
        found += node.auditor.cross_check(seq, node.ledger)
        if found:
            self.fail(node, [f"{node.name} " + text for text in found])
        handler = self.handle_p if node is self.p else self.handle_d
        for effect in effects:
            handler(node, effect)

    def fail(self, node: Node, found: list[str]) -> None:
        if not self.result.violations:
            self.result.failing_node = node.name
            self.result.failing_log = list(node.log)
        self.result.violations.extend(found)

    # -- P's shell -------------------------------------------------------------------------------

    def handle_p(self, node: Node, effect: fx.Effect) -> None:
        kind = type(effect)
        if kind is fx.FreeEngineBlocks:
            for block in effect.blocks:
                if node.owner.get(block) != effect.request:
                    self.fail(node, [f"P0 engine: block {block} freed for {effect.request} but held by "
                                     f"{node.owner.get(block)!r} (double free or wrong owner)"])
                    continue
                del node.owner[block]
                node.free.add(block)
        elif kind is fx.ReplyClaim:
            request = self.claims.get((effect.claimer, effect.ticket, effect.epoch))
            if request is None:
                return
            if effect.granted:
                grant = {"engine": P_NAME, "blocks": effect.blocks, "num_tokens": effect.num_tokens,
                         "digest": effect.digest}
                if self.fault("mismatched_grant"):
                    # The ticket holds another prompt than D's request (a client's mixed-up
                    # handoff section): D must refuse to read it and give the ticket back.
                    grant["digest"] = effect.digest + "-other"
                self.send(effect.claimer, ev.ClaimGranted, request=request, ticket=effect.ticket,
                          epoch=effect.epoch, **grant)
            else:
                self.send(effect.claimer, ev.ClaimRefused, request=request, ticket=effect.ticket,
                          epoch=effect.epoch, reason=effect.reason)
        elif kind is fx.ReplyRead:
            request = self.reads.get((effect.claimer, effect.read))
            if request is None:
                return
            if effect.granted:
                self.send(effect.claimer, ev.ReadGranted, request=request, read=effect.read,
                          asked_ns=self.read_asked.get((effect.claimer, effect.read), 0), pinned_ns=effect.pinned_ns)
            else:
                self.send(effect.claimer, ev.ReadRefused, request=request, read=effect.read,
                          reason=effect.reason)
        elif kind is fx.ReplyReadEnd:
            request = self.confirming.pop((effect.claimer, effect.read), None)
            if request is None:
                return
            if effect.held and (effect.claimer, request) in self.tainted:
                self.fail(node, [f"P0: read {effect.read} answered held, but it ended on {effect.claimer} after "
                                 f"P had let its blocks go"])
            self.send(effect.claimer, ev.ReadEndAnswered, request=request, read=effect.read, held=effect.held,
                      reason=effect.reason)
        elif kind is fx.StageHistory:
            ok = not self.fault("copy_failure")
            self.at(self.delay(0.5, 30), self.local, node, ev.HistoryPublished, {"ticket": effect.ticket, "ok": ok})
        elif kind is fx.DemoteHistory:
            ok = not self.fault("copy_failure")
            history = node.ledger.history
            if any(b.parent == effect.key and b.state == "PROMOTING" for b in history.blocks.values()):
                # The worst moment for a demotion to fail: a block below it is being promoted
                # (the whole subtree leaves, the promotion's end must find nothing).
                ok = ok and self.session_rng.random() > 0.5
            self.at(self.delay(0.5, 30), self.local, node, ev.HistoryDemoted, {"key": effect.key, "ok": ok})
        elif kind is fx.PromoteHistory:
            # Slower than other copies, so demotions and their failures meet promotions under way.
            for key in effect.keys:
                ok = self.session_rng.random() > 0.25
                wait = int(self.session_rng.uniform(1, 80) * MS)
                self.at(wait, self.local, node, ev.HistoryPromoted, {"key": key, "ok": ok})
            if self.session_rng.random() < 0.5 and not self.draining:
                # Other traffic while the promotion copies: the blocks above it may go down a tier.
                self.at(self.delay(0.1, 1), self.other_traffic, self.session_rng)
        elif kind is fx.ReplyRestore:
            if not effect.keys:
                return
            if self.fault("restore_abort"):
                self.at(self.delay(), self.local, node, ev.LeaseReleased,
                        {"lease": effect.lease, "request": effect.request, "epoch": 0})
            elif self.fault("lease_expiry"):
                self.at(self.config.history_lease_ns + self.delay(), self.local, node, ev.Tick, {})
            else:
                self.at(self.delay(), self.allocate_restore, node, effect.lease, effect.request, len(effect.keys))
        elif kind is fx.RestoreBlocks:
            start = self.delay(0.1, 2)
            if self.fault("restore_abort"):  # the request goes away before its copy starts
                self.at(self.delay(0, 1), self.local, node, ev.LeaseReleased,
                        {"lease": effect.lease, "request": self.lease_requests.get(effect.lease, ""), "epoch": 0})
            elif self.fault("lease_expiry"):  # the copy starts only after the lease ran out
                start += self.config.history_lease_ns + MS
                self.at(start - self.delay(0.05, 0.5), self.local, node, ev.Tick, {})
            ok = not self.fault("copy_failure")
            # The copy ends after it started, whatever order a stepped run picks actions in.
            self.at(start, self.copy_restore, node, effect.lease, ok, self.delay(2, 20))
        elif kind is fx.LeaseDone:
            for block in self.restore_blocks.pop(effect.lease, ()):
                node.owner.pop(block, None)
                node.free.add(block)

    def copy_restore(self, node: Node, lease: str, ok: bool, duration_ns: int) -> None:
        self.local(node, ev.LeaseReadStarted, {"lease": lease})
        self.at(duration_ns, self.local, node, ev.LeaseReadFinished, {"lease": lease, "ok": ok})

    def allocate_restore(self, node: Node, lease: str, request: str, count: int) -> None:
        count = self.rng.randint(1, count)
        blocks = node.allocate(f"restore:{lease}", count)
        if blocks is None:
            self.local(node, ev.LeaseReleased, {"lease": lease, "request": request, "epoch": 0})
            return
        self.local(node, ev.LeaseAllocated, {"lease": lease, "blocks": blocks, "request": request})
        record = node.ledger.leases.leases.get(lease)
        if record is None or record.state != "ALLOCATED" or record.blocks != blocks:
            # Refused (expired meanwhile, or a duplicate of an allocation the lease already
            # holds, or of one it held before it ended and gave the same blocks back): these
            # blocks are free at once; the lease keeps whatever it already had.
            for block in blocks:
                node.owner.pop(block, None)
                node.free.add(block)
        else:
            self.restore_blocks[lease] = blocks

    def local(self, node: Node, event_type, fields: dict) -> None:
        self.apply(node, event_type(at_ns=self.now, **fields))

    # -- D's shell -------------------------------------------------------------------------------

    def handle_d(self, node: Node, effect: fx.Effect) -> None:
        kind = type(effect)
        if kind is fx.SendClaim:
            self.claims[(node.name, effect.ticket, effect.epoch)] = effect.request
            self.send(P_NAME, ev.ClaimRequested, ticket=effect.ticket, claimer=node.name, epoch=effect.epoch)
            if self.fault("abort_before_claim"):  # the client goes away while P has not answered
                self.at(self.delay(0, 3), self.local, node, ev.RequestAborted, {"request": effect.request})
            if self.fault("allocate_before_grant"):
                self.at(self.delay(0, 2), self.allocate_load, node, effect.request, True)
        elif kind is fx.LoadResolved:
            if not effect.hit:
                return
            if self.fault("preempt_after_claim"):
                self.at(self.delay(), self.local, node, ev.RequestPreempted, {"request": effect.request})
            elif self.fault("abort_before_alloc"):
                self.at(self.delay(), self.local, node, ev.RequestAborted, {"request": effect.request})
            else:
                self.at(self.delay(0.1, 50), self.allocate_load, node, effect.request)
        elif kind is fx.SendReadStart:
            self.reads[(node.name, effect.read)] = effect.request
            self.read_ticket[(node.name, effect.read)] = (effect.ticket, self.ticket_request.get(effect.ticket, ""))
            self.read_epoch[(node.name, effect.read)] = effect.epoch
            self.read_asked[(node.name, effect.read)] = self.now
            if self.fault("expiry_between_reads"):
                self.clock_jump(self.config.claim_lease_ns + MS)
            self.send(P_NAME, ev.ReadStarted, ticket=effect.ticket, claimer=node.name, epoch=effect.epoch,
                      read=effect.read)
        elif kind is fx.PostRead:
            self.check_source_held(node, effect.read, "at read start")
            if self.fault("expiry_while_reading"):
                self.clock_jump(max(self.config.claim_lease_ns, self.config.unclaimed_ttl_ns) + MS)
            if self.fault("abort_while_loading"):
                self.at(self.delay(0.05, 2), self.local, node, ev.RequestAborted, {"request": effect.request})
            if self.fault("slow_read"):
                # The read outlasts its pin (P still holds it), or P's silent-reader bound too.
                self.clock_jump(self.rng.choice([self.config.reader_silence_ns // 2,
                                                 self.config.reader_silence_ns]) + MS)
            ok = not self.fault("transport_error")
            if (node.name, effect.request) in self.sync_loads and self.rng.random() < 0.15:
                # The step's wait was over before the grant reached the worker: it posts nothing.
                self.at(self.delay(0.05, 1), self.local, node, ev.LoadReadFinished,
                        {"request": effect.request, "read": effect.read, "ok": False, "abandoned": True})
                return
            self.at(self.delay(0.2, 10), self.finish_read, node, effect.request, effect.read, ok,
                    effect.pinned_until_ns)
            death = self.profile["decode_death"]
            if death and not self.draining and self.rng.random() < death * 0.2 \
                    and sum(d.alive for d in self.ds.values()) > 1:
                # D dies with this read in flight: only P's silent-reader rule can end it.
                self.result.faults["decode_death"] += 1
                self.kill(node)
        elif kind is fx.SendReadEnd:
            # A lost read end is never retried: P's silent-reader rule must end that read (D has
            # nothing more to say on the ticket once it released it).
            if effect.confirm:
                self.confirming[(node.name, effect.read)] = effect.request
                if self.fault("abort_while_loading"):  # before P's answer comes back
                    self.at(self.delay(0.01, 1), self.local, node, ev.RequestAborted, {"request": effect.request})
            if not self.fault("lost_read_end"):
                self.send(P_NAME, ev.ReadFinished, ticket=effect.ticket, read=effect.read, ok=effect.ok,
                          claimer=node.name, epoch=effect.epoch)
            if effect.release:
                self.send(P_NAME, ev.ReleaseRequested, ticket=effect.ticket, claimer=node.name, epoch=effect.epoch)
        elif kind is fx.SendRelease:
            self.send(P_NAME, ev.ReleaseRequested, ticket=effect.ticket, claimer=node.name, epoch=effect.epoch)
        elif kind is fx.ReportInvalidBlocks and (node.name, effect.request) in self.sync_loads:
            # Its workers reported its blocks in the step that needed them; a later report would
            # roll back the recompute that follows.
            self.fail(node, [f"{node.name}: synchronous load {effect.request} reported invalid blocks after its step"])
        elif kind is fx.LoadFinished:
            if effect.parked and (node.name, effect.request) in self.sync_loads:
                self.fail(node, [f"{node.name}: synchronous load {effect.request} reported received (vLLM parked "
                                 f"nothing)"])
            if effect.ok and (node.name, effect.request) in self.tainted:
                self.fail(node, [f"{node.name}: load {effect.request} counted a read that ended after P let "
                                 f"its blocks go"])
            for block, owner in list(node.owner.items()):
                if owner == effect.request:
                    del node.owner[block]
                    node.free.add(block)

    def allocate_load(self, node: Node, request: str, before_grant: bool = False) -> None:
        """The scheduler allocates the load's blocks: after P's grant, or before it (`before_grant`:
        vLLM's scheduler does not wait for P, and the load holds the allocation until P answers)."""

        load = node.ledger.loads.loads.get(request)
        wanted = loads.AWAITING_CLAIM if before_grant else loads.CLAIMED
        if load is None or load.state != wanted or not node.alive:
            return
        if not before_grant and self.fault("preempt_after_alloc"):
            blocks = node.allocate(request, load.num_blocks) or ()
            if blocks:
                self.local(node, ev.LoadAllocated, {"request": request, "blocks": blocks,
                                                    "reads": self.rng.randint(1, 3)})
            self.at(self.delay(0, 1), self.local, node, ev.RequestPreempted, {"request": request})
            return
        blocks = node.allocate(request, load.num_blocks)
        if blocks is None:  # D is full: the scheduler retries later (after the grant), the lease runs
            if not before_grant:
                self.at(self.delay(5, 100), self.allocate_load, node, request)
            return
        local_hit = self.rng.random() < 0.05
        # After the grant vLLM may run the request in this very step (a synchronous load).
        sync = not before_grant and self.rng.random() < 0.3
        if sync:
            self.sync_loads.add((node.name, request))
        self.local(node, ev.LoadAllocated, {"request": request, "blocks": () if local_hit else blocks,
                                            "reads": self.rng.randint(1, 3), "sync": sync})

    def finish_read(self, node: Node, request: str, read: str, ok: bool, pinned_until_ns: int = 0) -> None:
        if not node.alive:
            return
        in_pin = self.now <= pinned_until_ns
        if in_pin:
            self.check_source_held(node, read, "at read end")
        elif not self.source_held(node, read):
            self.tainted.add((node.name, request))  # D must not count it: P is asked first
        self.local(node, ev.LoadReadFinished, {"request": request, "read": read, "ok": ok, "in_pin": in_pin})

    def source_held(self, node: Node, read: str) -> bool:
        """P still has the read in flight, and the ticket's blocks still belong to its request."""

        ticket, request = self.read_ticket.get((node.name, read), ("", ""))
        record = self.p.ledger.tickets.tickets.get(ticket)
        if record is None or read not in record.reads:
            return False
        return all(self.p.owner.get(block) == request for block in record.blocks)

    def check_source_held(self, node: Node, read: str, when: str) -> None:
        """The model's oracle: P's blocks must still belong to the ticket's request while D reads
        (to its end, when it ends within its pin)."""

        ticket, request = self.read_ticket.get((node.name, read), ("", ""))
        record = self.p.ledger.tickets.tickets.get(ticket)
        blocks = record.blocks if record is not None else self.ticket_blocks.get(ticket, ())
        for block in blocks:
            if self.p.owner.get(block) != request:
                self.fail(self.p, [f"P0 engine: {node.name} reads block {block} of ticket {ticket} {when}, "
                                   f"but the block is now held by {self.p.owner.get(block)!r}"])
                return

    # -- router and workload ---------------------------------------------------------------------

    def clock_jump(self, jump_ns: int) -> None:
        self.result.faults["clock_jumped"] += 1
        self.now += jump_ns
        for node in self.nodes.values():
            self.apply(node, ev.Tick(at_ns=self.now))

    def new_request(self) -> None:
        if self.requests_left <= 0 or self.draining:
            return
        self.requests_left -= 1
        self.next_id += 1
        i = self.next_id
        request, ticket = f"r{i}", f"t{i}"
        doc = self.rng.choice(self.docs)
        n_blocks = self.rng.randint(1, 6)
        keys = tuple(f"{doc}.{j}" for j in range(n_blocks))
        p = self.p
        srng = self.session_rng
        if srng.random() < 0.4:
            # A turn of an agent session over this document (keep times from invalid to clamped).
            keep_ms = srng.choice([0, 20, 100, 400, 5000])
            self.local(p, ev.SessionKept, {"session": f"s-{doc}", "keys": keys[: srng.randint(1, n_blocks)],
                                           "keep_ns": keep_ms * MS})
        if self.rng.random() < 0.3:
            self.local(p, ev.HistoryObserved, {"keys": keys})
        if self.rng.random() < 0.4:
            lease = f"L{i}"
            self.lease_requests[lease] = request
            self.local(p, ev.RestoreRequested, {"lease": lease, "request": request, "epoch": 0, "keys": keys})
        blocks = p.allocate(request, n_blocks)
        if blocks is None:
            return
        self.ticket_request[ticket] = request
        self.ticket_blocks[ticket] = tuple(blocks)  # the oracle's own copy (records get pruned)
        if self.rng.random() < 0.15:
            # A plain request (no decode engine): its prompt goes to history, nobody claims it.
            self.local(p, ev.RetainRequested, {"ticket": ticket, "request": request, "blocks": blocks,
                                               "keys": keys[: self.rng.randint(0, n_blocks)]})
            if p.ledger.tickets.tickets.get(ticket) is None:  # rejected: the engine frees at once
                for block in blocks:
                    p.owner.pop(block, None)
                    p.free.add(block)
            return
        self.local(p, ev.TicketIssued, {"ticket": ticket, "request": request, "blocks": blocks,
                                        "keys": keys[: self.rng.randint(0, n_blocks)]})
        if p.ledger.tickets.tickets.get(ticket) is None:  # rejected: the engine frees at once
            self.ticket_blocks.pop(ticket, None)
            for block in blocks:
                p.owner.pop(block, None)
                p.free.add(block)
            return
        wait = self.delay(0.1, 30)
        if self.fault("claim_after_expiry"):
            wait += self.config.unclaimed_ttl_ns + MS
        if self.fault("router_cancel_before_claim"):
            self.at(self.delay(0, 2), self.send_later, P_NAME, ev.AbandonRequested, {"ticket": ticket})
        self.at(wait, self.route_to_decode, request, ticket, n_blocks, i)
        if self.fault("router_retry"):
            self.at(wait + self.delay(1, 50), self.route_to_decode, request, ticket, n_blocks, i + 10_000)
        if self.fault("router_cancel_after_claim"):
            self.at(wait + self.delay(1, 30), self.send_later, P_NAME, ev.AbandonRequested, {"ticket": ticket})

    def route_to_decode(self, request: str, ticket: str, n_blocks: int, epoch: int) -> None:
        alive = [d for d in self.ds.values() if d.alive]
        if not alive:
            return
        d = self.rng.choice(alive)
        d_request = f"{request}@{epoch}"
        self.local(d, ev.LoadRequested, {"request": d_request, "ticket": ticket, "source": P_NAME,
                                         "epoch": epoch, "num_blocks": n_blocks})

    def heartbeat(self) -> None:
        for d in self.ds.values():
            if not d.alive:
                continue
            for load in d.ledger.loads.loads.values():
                if load.state not in loads.SPEC.terminal:
                    self.send(P_NAME, ev.HeartbeatReceived, ticket=load.ticket, claimer=d.name)
        if not self.draining:
            self.at(self.config.unclaimed_ttl_ns // 3, self.heartbeat)

    def ticks(self) -> None:
        for node in self.nodes.values():
            self.apply(node, ev.Tick(at_ns=self.now))
        if not self.draining:
            self.at(self.delay(1, 60), self.ticks)

    def chaos(self) -> None:
        """Faults that strike at random moments rather than at a particular effect."""

        if self.draining:
            return
        if self.fault("clock_jump"):
            self.clock_jump(self.rng.choice([self.config.unclaimed_ttl_ns, self.config.claim_lease_ns,
                                             self.config.history_lease_ns]) + MS)
        srng = self.session_rng
        if srng.random() < 0.15:
            # An agent's tool call ended (its next turn is coming), or it is done with its session:
            # mostly an open session's, at times one that ended or never was.
            open_sessions = sorted(k for k, se in self.p.ledger.sessions.sessions.items() if se.state == "KEPT")
            session = (srng.choice(open_sessions) if open_sessions and srng.random() < 0.8
                       else f"s-{srng.choice(self.docs + ['unknown'])}")
            # (A turn the decode engine served alone only refreshes its keep time.)
            roll = srng.random()
            if roll < 0.7:
                self.local(self.p, ev.SessionPrefetchRequested, {"session": session, "promote": roll < 0.55})
            else:
                self.local(self.p, ev.SessionClosed, {"session": session})
        if srng.random() < 0.08 and not self.draining:
            self.other_traffic(srng)
        if self.fault("stale_message") and self.sent:
            to, event = self.rng.choice(self.sent)
            if isinstance(event, MESSAGE_TYPES):
                fields = {f: getattr(event, f) for f in event.__struct_fields__ if f != "at_ns"}
                self.at(0, self.deliver, to, type(event), fields)
        if self.rng.random() < self.profile["decode_death"] * 0.05:
            alive = [d for d in self.ds.values() if d.alive]
            if len(alive) > 1 or (alive and self.rng.random() < 0.5):
                self.result.faults["decode_death"] += 1
                self.kill(self.rng.choice(alive))
        self.at(self.delay(1, 40), self.chaos)

    def other_traffic(self, srng: random.Random) -> None:
        """A plain request of a prompt nobody returns to: history admits it, which pushes older
        blocks down a tier (sessions' kept ones included, once nothing else can go) for a later
        prefetch to bring back."""

        self.next_id += 1
        request, ticket = f"o{self.next_id}", f"to{self.next_id}"
        n_blocks = srng.randint(1, 4)
        blocks = self.p.allocate(request, n_blocks)
        if blocks is None:
            return
        keys = tuple(f"other{self.next_id}.{j}" for j in range(n_blocks))
        self.local(self.p, ev.RetainRequested, {"ticket": ticket, "request": request, "blocks": blocks, "keys": keys})
        if self.p.ledger.tickets.tickets.get(ticket) is None:
            for block in blocks:
                self.p.owner.pop(block, None)
                self.p.free.add(block)

    def kill(self, d: Node) -> None:
        """D dies: its messages stop. Its reads in flight on P end when P's core finds it silent
        (`reader_silence_ns`): P's transport never learns of one-sided reads."""

        d.alive = False

    # -- run -------------------------------------------------------------------------------------

    def run(self) -> SequenceResult:
        for i in range(self.requests_left):
            self.at(self.delay(0, 200) * (i + 1) // 2, self.new_request)
        self.at(0, self.ticks)
        self.at(0, self.heartbeat)
        self.at(self.delay(), self.chaos)
        processed = 0
        while self.agenda and processed < self.steps and not self.result.violations:
            self.step()
            processed += 1
        self.drain()
        return self.result

    def step(self) -> None:
        when, _, action, args = heapq.heappop(self.agenda)
        self.now = max(self.now, when)
        action(*args)

    def drain(self) -> None:
        """Heal and drain: no faults, deliver everything, then run time past every deadline."""

        self.draining = True
        self.requests_left = 0
        for _round in range(20):
            guard = 0
            while self.agenda and not self.result.violations and guard < 100_000:
                self.step()
                guard += 1
            if self.result.violations:
                return
            far = self.now + 100 * SECOND_NS * 1000
            self.now = far
            for node in self.nodes.values():
                self.apply(node, ev.Tick(at_ns=far))
            # A Tick can set a deadline of its own (a silent reader's ticket gets its idle lease
            # back): drained means nothing scheduled and no deadline left to fire.
            if not self.agenda and all(node.ledger.deadlines.next_ns() >= NEVER
                                       for node in self.nodes.values() if node.alive):
                break
        self.check_quiescent()

    def check_quiescent(self) -> None:
        leaks = []
        for node in self.nodes.values():
            if not node.alive:
                continue
            leaks += [f"{node.name} " + text for text in node.auditor.leaks()]
            open_counts = node.ledger.open_counts()
            leaks += [f"{node.name}: {n} {kind} still open" for kind, n in open_counts.items() if n]
            if node.owner:
                holders = sorted(set(node.owner.values()))
                leaks.append(f"{node.name} engine: {len(node.owner)} blocks never returned ({holders[:4]})")
        pinned = [k for k, b in self.p.ledger.history.blocks.items() if b.pins]
        if pinned:
            leaks.append(f"P0 history: blocks still pinned {pinned[:4]}")
        if leaks:
            if not self.result.failing_node:
                self.result.failing_node = P_NAME
                self.result.failing_log = list(self.p.log)
            self.result.leaks = leaks
