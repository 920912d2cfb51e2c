"""Hypothesis drives D's real scheduler side against its real sidecar (a `ListIo`), a scripted P
and a modelled engine: requests that carry a handoff, their n > 1 siblings, engine steps that ask,
allocate (before or after P answered) and preempt, P granting or refusing, reads that succeed or
fail, synchronous loads (P's grant in hand when the step is scheduled: the step waits for the
read, which succeeds, fails, or is not posted in time and then never is), aborts and finishes, all
in an order hypothesis chooses.

Oracles, after every step: vLLM's contract (a request hears `finished_recving` only when it was
parked for a load, and at most once), the ledger's invariants, invalid blocks only among a
request's own allocation and never for a synchronous load after its step. After the drain (every request ended, time run past every deadline):
nothing open in the ledger, no slot or reader left on the scheduler side, every parked request
told once, and every ticket P granted given back (released, or its read ended with a release).
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvbaton.adapters.vllm import scheduler_side as c  # noqa: E402
from kvbaton.adapters.vllm.handoff import handoff_key, prompt_digest, sign_handoff  # noqa: E402
from kvbaton.adapters.vllm.identity import KvIdentity  # noqa: E402
from kvbaton.adapters.vllm.settings import parse_peer_networks  # noqa: E402
from kvbaton.control import messages as m  # noqa: E402
from kvbaton.control import peer as pc  # noqa: E402
from kvbaton.control.ranks import pack_metadata  # noqa: E402
from kvbaton.core import events as ev  # noqa: E402
from kvbaton.core.ledger import SECOND_NS, LedgerConfig  # noqa: E402
from kvbaton.testing.fake_io import LAYOUT, listed_sidecar, run_spawned  # noqa: E402

BLOCK = 16
P_CONTROL = "127.0.0.1:9000"
P_INSTANCE = "a" * 32
KEY = handoff_key("5d0c9e27a41f86b3c2e7d19a04b6f835")
CONFIG = LedgerConfig(claim_wait_ns=2 * SECOND_NS, read_grant_wait_ns=2 * SECOND_NS, claim_lease_ns=5 * SECOND_NS)


class Link:
    """The scheduler side's link to its sidecar: facts go in through the wire format; the
    sidecar's decisions for the scheduler come back on `drain`."""

    def __init__(self, sidecar) -> None:
        self.sidecar = sidecar
        self.address = "127.0.0.1:1"
        self.instance = "b" * 32
        self.router_address = ""

    def send(self, msg) -> bool:
        self.sidecar.on_message(m.DECODER.decode(m.ENCODER.encode(msg)), 0)
        return True

    def drain(self) -> list:
        out = [msg for dest, msg in self.sidecar.io.sent if dest == "scheduler"]
        self.sidecar.io.sent[:] = [(dest, msg) for dest, msg in self.sidecar.io.sent if dest != "scheduler"]
        return out

    def alive(self) -> bool:
        return True


class P:
    """P as its sidecar answers: a grant for what the request holds (or a refusal, as drawn),
    read starts granted; it keeps which tickets it granted and which it got back."""

    def __init__(self) -> None:
        self.requests: dict[str, SimpleNamespace] = {}  # ticket -> the request it was issued for
        self.refuse: set[str] = set()
        self.granted: set[str] = set()
        self.given_back: set[str] = set()
        self.let_go: set[tuple[str, str]] = set()  # (request, read) P ended (its reader silent): their end is not confirmed

    async def call(self, payload: bytes) -> bytes:
        call = pc.decode_call(payload).call
        kind = type(call)
        if kind is pc.Claim:
            request = self.requests.get(call.ticket)
            if request is None or call.ticket in self.refuse:
                answer = pc.ClaimAnswer(False, "closed: expired", instance=P_INSTANCE)
            else:
                self.granted.add(call.ticket)
                tokens = len(request.prompt_token_ids)
                answer = pc.ClaimAnswer(True, "", "P0", LAYOUT, tuple(range(-(-tokens // BLOCK))), tokens,
                                        prompt_digest(request, tokens), P_INSTANCE)
        elif kind is pc.Metadata:
            answer = pc.MetadataAnswer("P0", pack_metadata([b"p-metadata"]), P_INSTANCE)
        else:
            if kind is pc.Release or (kind is pc.ReadEnd and call.release):
                self.given_back.add(call.ticket)
            held = not (kind is pc.ReadEnd and any(read == call.read for _, read in self.let_go))
            answer = pc.Answer(True) if held else pc.Answer(False, "unknown read")
        return pc.ENCODER.encode(answer)


class Blocks:
    def __init__(self, ids) -> None:
        self.ids = list(ids)

    def get_block_ids(self):
        return (self.ids,)


def scheduler_side(link: Link) -> c.SchedulerSide:
    # A claim not answered by the step that asks is parked at once; an answered one loads
    # synchronously.
    settings = SimpleNamespace(sync_loads="auto", sync_claim_wait_s=0.0, sync_load_max_s=0.05)
    conn = SimpleNamespace(is_consumer=True, is_producer=False, layout=LAYOUT, block_size=BLOCK, engine_id="D0",
                           identity=KvIdentity(LAYOUT, "W", 1), settings=settings)
    return c.SchedulerSide.attached(conn, link, handoff_key=KEY, trusted=parse_peer_networks("127.0.0.0/8"))


class DecodeEngine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        import tempfile
        from pathlib import Path

        self.sidecar = listed_sidecar(Path(tempfile.mkdtemp()), "D0", "consumer", CONFIG)
        self.sidecar.io.keep_spawned = True
        self.p = P()
        self.sidecar.io.peers[P_CONTROL] = self.p
        self.link = Link(self.sidecar)
        self.side = scheduler_side(self.link)
        self.loop = asyncio.new_event_loop()
        self.requests: dict[str, SimpleNamespace] = {}
        self.waiting: list[str] = []  # requests the engine asks about each step
        self.allocated: dict[str, tuple[int, ...]] = {}
        self.parked: set[str] = set()
        self.told: dict[str, int] = {}  # finished_recving per request
        self.next_block = itertools.count(100)
        self.reads: list = []  # reads the worker has in flight (PostRead)
        self.sync: set[str] = set()  # requests vLLM ran in the step that allocated them
        self.abandoned: set[str] = set()  # synchronous loads whose step stopped waiting unposted
        self.violations: list[str] = []

    def teardown(self) -> None:
        self.loop.close()

    # -- the world ----------------------------------------------------------------------------

    def deliver_worker_messages(self) -> None:
        """What the sidecar told the worker: received reports counted; reads done at once or
        failed as drawn (`fail`); invalid blocks checked against the request's allocation."""

        io = self.sidecar.io
        sent, io.sent[:] = [(d, msg) for d, msg in io.sent if d != "scheduler"], \
            [(d, msg) for d, msg in io.sent if d == "scheduler"]
        for _dest, msg in sent:
            kind = type(msg)
            if kind is m.FinishedRecving:
                self.received(msg.request)
            elif kind is m.InvalidBlocks:
                if not set(msg.blocks) <= set(self.allocated.get(msg.request, ())):
                    self.violations.append(f"{msg.request}: invalid blocks {msg.blocks} it was not allocated")
                if msg.request in self.sync:  # its step reported them; this would roll back its recompute
                    self.violations.append(f"{msg.request}: invalid blocks after its synchronous step")
            elif kind is m.PostRead and msg.request in self.abandoned:  # the worker never posts it
                self.sidecar.on_message(m.ReadDone(msg.request, msg.read, False, "sync wait passed",
                                                   abandoned=True), 0)
            elif kind is m.PostRead:
                self.reads.append(msg)

    def received(self, request: str) -> None:
        if request not in self.parked:
            self.violations.append(f"{request}: finished_recving, never parked for a load")
        self.told[request] = self.told.get(request, 0) + 1
        if self.told[request] > 1:
            self.violations.append(f"{request}: finished_recving twice")

    def settle(self) -> None:
        """Run the peer calls the sidecar started, and hand what it told the worker over."""

        for _ in range(8):
            self.loop.run_until_complete(run_spawned(self.sidecar.io))
            self.deliver_worker_messages()
            if not self.sidecar.io.spawned:
                break

    # -- rules --------------------------------------------------------------------------------

    @rule(tokens=st.integers(min_value=1, max_value=5 * BLOCK), siblings=st.integers(min_value=0, max_value=2),
          refused=st.booleans())
    def arrive(self, tokens, siblings, refused):
        ticket = uuid.uuid4().hex
        params = {"do_remote_prefill": True, "kvbaton": sign_handoff({
            "ticket": ticket, "control": P_CONTROL, "num_tokens": tokens, "layout": LAYOUT, "weights": "W",
            "tp": 1, "keepalive": uuid.uuid4().hex, "instance": P_INSTANCE}, KEY, 120)}
        parent = uuid.uuid4().hex[:8]
        for i in range(1 + siblings):
            request = SimpleNamespace(request_id=f"{i}_{parent}", kv_transfer_params=params,
                                      prompt_token_ids=list(range(7, 7 + tokens)), status=RequestStatus.WAITING,
                                      cache_salt=None, lora_request=None, mm_features=None)
            self.requests[request.request_id] = request
            self.waiting.append(request.request_id)
            if i == 0:
                self.p.requests[ticket] = request
                if refused:
                    self.p.refuse.add(ticket)
            self.side.on_new_request(request)
        self.deliver_worker_messages()

    @precondition(lambda self: self.sidecar.io.spawned)
    @rule()
    def network(self):
        self.settle()

    @precondition(lambda self: self.waiting)
    @rule(local_hit=st.sampled_from([0, 0, BLOCK]), answered=st.booleans(),
          sync_read=st.sampled_from(["ok", "ok", "fails", "late"]))
    def engine_step(self, local_hit, answered, sync_read):
        """vLLM's scheduler asks about every waiting request: allocates what the connector
        offers (parking the request, or running it in this step: a synchronous load), or runs it
        (the handoff is over or refused). With `answered`, the sidecar's calls went out and came
        back before the step. The step's synchronous loads end as `sync_read` says."""

        if answered:
            self.settle()
        for rid in list(self.waiting):
            request = self.requests[rid]
            hit = min(local_hit, len(request.prompt_token_ids) - 1) // BLOCK * BLOCK
            count, load_async = self.side.get_num_new_matched_tokens(request, hit)
            if count is None:
                continue
            self.waiting.remove(rid)
            if count > 0:
                blocks = tuple(next(self.next_block) for _ in range(-(-(hit + count) // BLOCK)))
                self.allocated[rid] = blocks
                self.side.update_state_after_alloc(request, Blocks(blocks), count)
                if load_async:
                    self.parked.add(rid)
                    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            else:
                request.status = RequestStatus.RUNNING
        self.side.build_connector_meta(SimpleNamespace(preempted_req_ids=set()))
        for rid in self.side.take_sync_step():  # what the connector gives the step's workers
            self.sync_step(rid, sync_read)
        self.deliver_worker_messages()

    def sync_step(self, rid: str, how: str) -> None:
        """The step's workers wait for a synchronous load: its read is granted and ends well or
        fails ("late": P's grant comes after the step stopped waiting, so no read is ever
        posted). vLLM runs the request on what was read, or rolls it back to recompute."""

        request = self.requests[rid]
        self.sync.add(rid)
        if how != "late":
            self.settle()  # the read start goes to P and its grant comes back while the step waits
        posted = [msg for msg in self.reads if msg.request == rid]
        runs = False
        if posted:  # a posted read is waited out
            self.reads.remove(posted[0])
            ok = how != "fails"
            self.sidecar.on_message(m.ReadDone(rid, posted[0].read, ok, "" if ok else "injected", 4096, 0.001,
                                               in_pin=True), 0)
            runs = ok and posted[0].last
        else:
            self.abandoned.add(rid)
        if runs:
            request.status = RequestStatus.RUNNING
        else:  # its blocks were reported invalid in the step: rolled back, asked again
            request.status = RequestStatus.WAITING
            self.waiting.append(rid)
    @precondition(lambda self: self.reads)
    @rule(ok=st.sampled_from([True, True, True, False]), index=st.integers(min_value=0, max_value=100),
          in_pin=st.sampled_from([True, True, False]), let_go=st.booleans())
    def read_ends(self, ok, index, in_pin, let_go):
        """The worker's read ends; on success of its last read within its pin it tells vLLM itself.
        Past its pin the sidecar asks P, which may have let the read go (`let_go`)."""

        msg = self.reads.pop(index % len(self.reads))
        if ok and msg.last and in_pin and msg.request in self.parked:
            self.received(msg.request)
        if not in_pin and let_go:
            self.p.let_go.add((msg.request, msg.read))
        self.sidecar.on_message(m.ReadDone(msg.request, msg.read, ok, "" if ok else "injected", 4096, 0.001,
                                           in_pin=in_pin), 0)
        self.deliver_worker_messages()

    @precondition(lambda self: any(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and self.told.get(rid)
                                   for rid, r in self.requests.items()))
    @rule()
    def loaded_requests_run(self):
        for rid, request in self.requests.items():
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and self.told.get(rid):
                request.status = RequestStatus.RUNNING

    @precondition(lambda self: any(r.status == RequestStatus.RUNNING for r in self.requests.values()))
    @rule(index=st.integers(min_value=0, max_value=100), preempt=st.booleans())
    def run_or_preempt(self, index, preempt):
        running = [rid for rid, r in self.requests.items() if r.status == RequestStatus.RUNNING]
        rid = running[index % len(running)]
        request = self.requests[rid]
        if preempt:  # back to waiting: asked again, its handoff consumed
            request.status = RequestStatus.PREEMPTED
            self.side.build_connector_meta(SimpleNamespace(preempted_req_ids={rid}))
            request.status = RequestStatus.WAITING
            self.waiting.append(rid)
        else:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            self.finish(rid)
        self.deliver_worker_messages()

    @precondition(lambda self: any(not r.status.name.startswith("FINISHED") for r in self.requests.values()))
    @rule(index=st.integers(min_value=0, max_value=100))
    def abort(self, index):
        live = [rid for rid, r in self.requests.items() if not r.status.name.startswith("FINISHED")]
        rid = live[index % len(live)]
        self.requests[rid].status = RequestStatus.FINISHED_ABORTED
        self.finish(rid)
        self.deliver_worker_messages()

    def finish(self, rid: str) -> None:
        if rid in self.waiting:
            self.waiting.remove(rid)
        self.side.request_finished(self.requests[rid], [list(self.allocated.get(rid, ()))])

    @rule(seconds=st.sampled_from([0.1, 1.0, 3.0]))
    def time_passes(self, seconds):
        self.sidecar.io.clock_ns += int(seconds * SECOND_NS)
        self.sidecar.apply(ev.Tick(self.sidecar.io.now_ns()))
        self.deliver_worker_messages()

    # -- oracles ------------------------------------------------------------------------------

    @invariant()
    def contract_holds(self):
        assert self.violations == [], self.violations
        assert self.sidecar.ledger.check_invariants() == []

    def drain(self) -> None:
        """End every request, run time past every deadline, then nothing may be left."""

        # Reads in flight end well, loaded requests run and finish; what still waits is aborted.
        for _ in range(4):
            self.settle()
            while self.reads:
                msg = self.reads.pop(0)
                if msg.last and msg.request in self.parked:
                    self.received(msg.request)
                self.sidecar.on_message(m.ReadDone(msg.request, msg.read, True, "", 4096, 0.001, in_pin=True), 0)
                self.deliver_worker_messages()
        for rid, request in self.requests.items():
            if not request.status.name.startswith("FINISHED"):
                loaded = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and self.told.get(rid)
                running = request.status == RequestStatus.RUNNING or loaded
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED if running else RequestStatus.FINISHED_ABORTED
                self.finish(rid)
        for _ in range(6):
            self.settle()
            while self.reads:
                msg = self.reads.pop(0)
                self.sidecar.on_message(m.ReadDone(msg.request, msg.read, False, "drained", 0, 0.0), 0)
            self.sidecar.io.clock_ns += 30 * SECOND_NS
            self.sidecar.apply(ev.Tick(self.sidecar.io.now_ns()))
            self.deliver_worker_messages()
        self.settle()
        ledger = self.sidecar.ledger
        open_loads = [ld for ld in ledger.loads.loads.values() if ld.state not in ("DONE", "MISSED", "FAILED", "CANCELLED")]
        assert open_loads == [], open_loads
        assert self.side.slots == {} and self.side.readers == {}, (self.side.slots, self.side.readers)
        for rid in self.parked:
            assert self.told.get(rid) == 1, f"{rid}: parked, told received {self.told.get(rid, 0)} times"
        assert self.p.granted <= self.p.given_back, f"granted, never given back: {self.p.granted - self.p.given_back}"
        assert self.violations == [], self.violations


class DrainedDecodeEngine(DecodeEngine):
    def teardown(self) -> None:
        try:
            self.drain()
        finally:
            super().teardown()


DrainedDecodeEngine.TestCase.settings = settings(
    max_examples=int(__import__("os").environ.get("KVBATON_STATEFUL_EXAMPLES", "60")), stateful_step_count=30,
    deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestDecodeScheduler = DrainedDecodeEngine.TestCase
