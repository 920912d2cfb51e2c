"""`kvbaton fuzz --shell`: the simulator on the real shell.

The core simulator (`swarm.py`) drives ledgers with a model of the shell. This one runs the shell
itself: one prefill and two decode engines, each with the production `Sidecar` (its event
stamping, effect carrying, claim retries, read calls, heartbeats and timers), exchanging the real
encoded peer calls and connector messages, and every engine with the connector's own scheduler
side (`SchedulerSide`), which a modelled vLLM scheduler steps: on P it issues and signs the
tickets (`request_finished`), keeps plain prompts for history and asks history for returning ones
(the lease, its allocation, a retry with another local hit); on D it checks P's signed section, claims, allocates while
the claim is out or after P answered, keeps n > 1 siblings waiting for their reader and relays
preemptions and aborts. Its ids come from the sequence's seed and its waits from the virtual
clock. Only the outside world is simulated: the network between sidecars (latency, lost calls and
answers, a dead host refusing), vLLM's scheduler and each engine's worker (engine steps, reads,
aborts, preemptions of running requests, deaths; their messages reach the sidecar in order but
late, so a claim can beat P's own ticket), P's history copier
(stages, demotions and restores that end late or fail, in most sequences), and the clock. Every
sidecar runs on one asyncio loop whose time is virtual: a sleep or a call timeout costs nothing,
and a sequence replays exactly from its seed.

Oracles: the auditor on every ledger after every event, the core's invariants every few events;
after every sequence and its drain (virtual time run on until every deadline passed), the
invariants again; nothing open; P's blocks each returned once; every request vLLM parked for a load
or a restore told it was received exactly once; no request run on a read that ended after P let
its blocks go (unless those blocks were reported invalid); every restore copying only resident, pinned slots;
no shell task left running; every decode request finished and forgotten by its scheduler side
(no slot, no reader, no connector error); and in a sequence without faults, every handoff read and released (no
ticket closed by its lease, no load missed).

`--break` runs a deliberately broken shell, which these oracles must catch: `dropped_release`
(the sidecar forgets to release a ticket), `endless_claim_retry` (a claim retry that forgets its
deadline and whether its load still waits), `lost_finished_recving` (an ended load or restore
never tells vLLM its parked request was received), `unpinned_reads` (reads posted without their
pin deadline: a read that ended after P let its blocks go is counted) and `unsynced_reads` (a
synchronous load's reads posted as a parked load's: the worker tells vLLM of a request it did not
park, and the step that runs it waits for reads nobody reports to it).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
import selectors
from collections import Counter
from dataclasses import dataclass, field
from functools import cache
from types import SimpleNamespace

import msgspec

from ..control import messages as m
from ..control.config import SidecarConfig
from ..control.guard import capability_digest
from ..control.sidecar import Sidecar
from ..core import effects as fx
from ..core import events as ev
from ..core.audit import Auditor
from ..core.common import NEVER
from ..core.ledger import SECOND_NS, LedgerConfig
from ..core.machine import InternalError

MS = SECOND_NS // 1000
BLOCK_SIZE = 16
LAYOUT = "sim-layout"
BREAKS = ("dropped_release", "endless_claim_retry", "lost_finished_recving", "unpinned_reads", "unsynced_reads")
SHELL_FAULTS = ("lost_call", "lost_answer", "transport_error", "abort", "preempt", "decode_death", "prefill_death",
                "copy_failure", "restore_abort", "slow_read")
# Rare paths the faults should reach, counted by the decode engines' ledgers (loads.<name>).
OUTCOMES = ("reads_confirmed", "reads_unpinned")
# A slow read takes this long (virtual seconds): past D's pin on it (half P's silent-reader bound),
# and when D's control path is cut meanwhile, past P's bound itself.
SLOW_READ_S = (1.2, 5.0)
DOCUMENTS = 6  # prompts come from a few documents, so they return and history has something to restore
WEIGHTS = "sim-weights"
KV_HEADS = 4  # heads split over 1 or 2 ranks: engines of either size read each other's
# The deployment secret's handoff key: P signs its answers with it, D's scheduler side checks them.
HANDOFF_SECRET = "6f1d93b2c48e07a5d3b9f26e1c70a84e"
SIM_NETWORK = "198.18.0.0/15"
SYNC_LOAD_WAIT_S = 0.1  # how long a step waits for a synchronous load's read to be posted
STEP_STUCK_S = 30.0  # a step still waiting this long after that has hung the engine


@cache
def RequestStatus():  # noqa: N802 - vLLM's enum, imported once the shell simulator needs it
    from vllm.v1.request import RequestStatus as status

    return status


def prefill_scheduler(engine: Engine):
    """P's scheduler side, the connector's own code: it issues the tickets (and signs the handoff
    sections D checks), keeps plain prompts for history and asks history for returning ones.
    Its ids and capabilities come from the sequence's seed and its waits from the virtual clock."""

    from ..adapters.vllm.handoff import handoff_key
    from ..adapters.vllm.identity import KvIdentity
    from ..adapters.vllm.scheduler_side import SchedulerSide
    from ..adapters.vllm.settings import parse_peer_networks

    world = engine.world
    conn = SimpleNamespace(is_consumer=False, is_producer=True, layout=LAYOUT, block_size=BLOCK_SIZE,
                           engine_id=engine.name, identity=KvIdentity(LAYOUT, WEIGHTS, engine.ranks, KV_HEADS),
                           settings=SimpleNamespace(history_scope="all", unclaimed_ttl_s=3600.0,
                                                    require_router_capability=False))
    plan = SimpleNamespace(enabled=world.history, gpu_slots=0, cpu_slots=0)

    def seeded_id() -> str:
        return f"{world.rng.getrandbits(128):032x}"

    return SchedulerSide.attached(conn, SchedulerLink(engine), handoff_key=handoff_key(HANDOFF_SECRET),
                                  trusted=parse_peer_networks(SIM_NETWORK), plan=plan,
                                  kv_cache_config=SimpleNamespace(hash_block_size=BLOCK_SIZE), new_id=seeded_id,
                                  mint=seeded_id, clock=world.loop.time)


def decode_scheduler(engine: Engine):
    """D's scheduler side, the connector's own code, on a link to the engine's sidecar."""

    from ..adapters.vllm.handoff import handoff_key
    from ..adapters.vllm.identity import KvIdentity
    from ..adapters.vllm.scheduler_side import SchedulerSide
    from ..adapters.vllm.settings import parse_peer_networks

    # Two sequences in three load synchronously what was granted by the step that asks (the
    # others park every load): derived from the seed, so older seeds' random streams stay the same.
    settings = SimpleNamespace(sync_loads="auto" if engine.world.seed % 3 else "off", sync_claim_wait_s=0.01,
                               sync_load_max_s=0.05)
    conn = SimpleNamespace(is_consumer=True, is_producer=False, layout=LAYOUT, block_size=BLOCK_SIZE,
                           engine_id=engine.name, identity=KvIdentity(LAYOUT, WEIGHTS, engine.ranks, KV_HEADS),
                           settings=settings)
    return SchedulerSide.attached(conn, SchedulerLink(engine), handoff_key=handoff_key(HANDOFF_SECRET),
                                  trusted=parse_peer_networks(SIM_NETWORK), clock=engine.world.loop.time)


class Stalled(RuntimeError):
    """The loop has nothing left to run and nothing scheduled: the simulation cannot go on."""


class Clock:
    def __init__(self) -> None:
        self.now_ns = SECOND_NS

    def advance(self, seconds: float) -> None:
        self.now_ns += max(1, math.ceil(seconds * 1e9))


class VirtualSelector(selectors.DefaultSelector):
    """asyncio waits here for I/O or its next timer: with no I/O ready, time jumps to the timer."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout=None):
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise Stalled("nothing scheduled")
        self.clock.advance(timeout)
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: Clock) -> None:
        super().__init__(VirtualSelector(clock))
        self.clock = clock

    def time(self) -> float:
        return self.clock.now_ns / 1e9


class FakeRef:
    """A peer's sidecar as the network shows it: latency both ways, calls and answers that get
    lost (the caller's bound ends them), a caller whose control path is cut for a while (its calls
    are lost; its worker's transfers go on), and a dead or absent host that refuses at once."""

    def __init__(self, world: World, address: str, caller: str = "") -> None:
        self.world, self.address, self.caller = world, address, caller

    async def call(self, payload: bytes) -> bytes:
        world = self.world
        await asyncio.sleep(world.latency())
        target = world.by_address.get(self.address)
        if target is None or not target.alive:
            raise ConnectionRefusedError(f"nobody listens at {self.address}")
        if world.fault("lost_call") or world.clock.now_ns < world.cut_until.get(self.caller, 0):
            await asyncio.sleep(3600)
        answer = target.sidecar.server.answer_frame(payload)
        await asyncio.sleep(world.latency())
        if world.fault("lost_answer"):
            await asyncio.sleep(3600)
        return answer


class SimIo:
    """The sidecar's IO in the simulated world (control/io.py): the world's clock, its network
    (FakeRef) and the engine's scheduler and worker in place of sockets."""

    # The wall clock is the virtual one from a fixed epoch: frames are stamped and checked with it.
    WALL_EPOCH_NS = 1_700_000_000 * SECOND_NS

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tasks: set[asyncio.Task] = set()

    def now_ns(self) -> int:
        return self.engine.world.clock.now_ns

    def wall_ns(self) -> int:
        return self.WALL_EPOCH_NS + self.engine.world.clock.now_ns

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        """A shell task that raised is a bug the oracles report (the process would only log it)."""

        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.engine.world.violation(self.engine, f"a shell task failed: {task.exception()!r}")

    def send(self, dest: str, msg: m.Msg, rank: int | None = None) -> None:
        # Through the wire format, delivered after the sending code returns (a socket's order).
        decoded = m.DECODER.decode(m.ENCODER.encode(msg))
        if self.engine.ranks == 1:
            rank = None  # one rank: its message is every rank's
        asyncio.get_running_loop().call_soon(self.engine.receive, dest, decoded, rank)

    async def connect(self, address: str) -> FakeRef:
        return FakeRef(self.engine.world, address, self.engine.name)

    async def disconnect(self, address: str) -> None:
        pass

    async def exit(self) -> None:
        pass


def observed_ledger(engine: Engine, sidecar: Sidecar) -> None:
    """Every event the sidecar applies is audited; the invariants are checked every few events."""

    world, auditor, ledger = engine.world, engine.auditor, sidecar.ledger
    ledger_apply = ledger.apply

    def observed_apply(event: ev.Event) -> list[fx.Effect]:
        try:
            effects = ledger_apply(event)
        except InternalError as exc:
            world.violation(engine, str(exc))
            return []
        world.events += 1
        seq = world.events
        for text in auditor.observe(seq, event, effects):
            world.violation(engine, text)
        if seq % world.invariant_every == 0:
            for text in ledger.check_invariants():
                world.violation(engine, text)
        return effects

    ledger.apply = observed_apply


class DroppedRelease(Sidecar):
    """Broken on purpose: releases are never sent (a read's end no longer releases either)."""

    def carry(self, effect: fx.Effect) -> None:
        if type(effect) is fx.SendRelease:
            return
        if type(effect) is fx.SendReadEnd and effect.release:
            effect = msgspec.structs.replace(effect, release=False)
        super().carry(effect)


class EndlessClaimRetry(Sidecar):
    """Broken on purpose: a claim retries as long as it is refused, whether its load waits or not."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.client.claim_retry_deadline = lambda: math.inf
        self.client.awaiting_claim = lambda effect: True


class LostFinishedRecving(Sidecar):
    """Broken on purpose: an ended load or lease forgets that vLLM parked its request."""

    def carry(self, effect: fx.Effect) -> None:
        if type(effect) in (fx.LoadFinished, fx.LeaseDone) and effect.parked:
            effect = msgspec.structs.replace(effect, parked=False)
        super().carry(effect)


class UnpinnedReads(Sidecar):
    """Broken on purpose: reads are posted without their pin deadline, so the worker counts every
    read that succeeds, even one that ended after P let its blocks go."""

    def carry(self, effect: fx.Effect) -> None:
        if type(effect) is fx.PostRead:
            effect = msgspec.structs.replace(effect, pinned_until_ns=NEVER)
        super().carry(effect)


class UnsyncedReads(Sidecar):
    """Broken on purpose: a synchronous load's reads are posted as a parked load's, so the worker
    reports them to vLLM (received) instead of to the step that waits for them."""

    def carry(self, effect: fx.Effect) -> None:
        if type(effect) is fx.PostRead:
            effect = msgspec.structs.replace(effect, sync=False)
        super().carry(effect)


SIDECAR_CLASSES = {"": Sidecar, "dropped_release": DroppedRelease, "endless_claim_retry": EndlessClaimRetry,
                   "lost_finished_recving": LostFinishedRecving, "unpinned_reads": UnpinnedReads,
                   "unsynced_reads": UnsyncedReads}


@dataclass
class Handoff:
    request: str
    ticket: str
    num_tokens: int
    digest: str
    keepalive: str
    source: Engine
    params: dict = field(default_factory=dict)  # what P's answer carries (`kv_transfer_params`)
    tokens: list = field(default_factory=list)  # the prompt's token ids


@dataclass
class DecodeRequest:
    handoff: Handoff
    blocks: tuple[int, ...] = ()
    parked: bool = False  # blocks allocated for the load: vLLM waits for one finished_recving per rank
    received: Counter = field(default_factory=Counter)  # rank -> finished_recving reports
    aborted: bool = False
    tainted: bool = False  # a read of it ended after P had let its blocks go
    invalid: bool = False  # some of its blocks were reported invalid (vLLM recomputes them)
    request: object = None  # D: the request as vLLM's scheduler hands it to the connector
    # A synchronous load: vLLM runs it in the step that allocated it, whose workers wait for its
    # read. Per rank: a read posted for it, how it ended (ok in its pin), or given up unposted.
    sync: bool = False
    posted: set = field(default_factory=set)
    ended: dict = field(default_factory=dict)
    abandoned: set = field(default_factory=set)


class Blocks:
    """The blocks vLLM allocated for a request, as the connector is given them."""

    def __init__(self, ids) -> None:
        self.ids = list(ids)

    def get_block_ids(self):
        return (self.ids,)


class SchedulerLink:
    """A scheduler side's link to its engine's sidecar: facts go to the sidecar's inbox (late, in
    order); its decisions for the scheduler wait in `inbox` until the scheduler drains them."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.address = engine.address
        self.router_address = ""
        self.inbox: list = []

    @property
    def instance(self) -> str:
        return self.engine.sidecar.instance

    def send(self, msg) -> bool:
        self.engine.send(msg)
        return True

    def drain(self) -> list:
        out, self.inbox = self.inbox, []
        return out

    def alive(self) -> bool:
        return self.engine.alive


class Engine:
    """One engine: its sidecar, plus the scheduler and worker the world simulates."""

    def __init__(self, world: World, name: str, role: str, address: str, sidecar_class, ranks: int = 1) -> None:
        self.world, self.name, self.role, self.address = world, name, role, address
        self.alive = True
        # Worker ranks (tensor parallelism): each answers every read, copy and restore itself,
        # late or failed on its own; the sidecar must make one fact of their answers.
        self.ranks = ranks
        self.auditor = Auditor(world.config.reader_silence_ns)
        cfg = SidecarConfig(engine_id=name, role=role, ledger=world.config, address=address,
                            ipc_dir=f"/nonexistent/{name}", heartbeat_interval_s=0.5, call_timeout_s=1.0,
                            tick_interval_s=0.05, layout=LAYOUT, block_size=BLOCK_SIZE, ranks=ranks)
        world.instances += 1
        self.io = SimIo(self)
        # Strict: a machine's bug fails the run where it happens. The instance is seeded, as
        # everything else here: loads record the P instance a ticket came from.
        self.sidecar = sidecar_class(cfg, self.io, address=address, strict=True,
                                     instance=f"{world.instances:032x}")
        observed_ledger(self, self.sidecar)
        # The connector's scheduler side, stepped by a modelled vLLM scheduler.
        self.scheduler = decode_scheduler(self) if role == "consumer" else prefill_scheduler(self)
        self.waiting: list[str] = []  # requests vLLM's scheduler asks about at its next step
        self.preempting: set[str] = set()
        self.step_due = False
        self.stepping = 0  # synchronous loads the step in progress waits for (no step starts meanwhile)
        self.next_block = 0
        self.inbox_at = 0.0
        self.tickets: dict[str, tuple[str, tuple[int, ...]]] = {}  # P: ticket -> (request, blocks)
        self.freed: Counter = Counter()  # P: request -> finished_sending count
        self.requests: dict[str, DecodeRequest] = {}  # D; on P, the requests restoring from history

    def start(self) -> None:
        sidecar = self.sidecar
        self.io.spawn(sidecar.timer_loop())
        if self.role == "consumer":
            self.io.spawn(sidecar.client.heartbeat_loop())
        else:
            for rank in range(self.ranks):
                self.send(m.WorkerReady(b"sim-metadata", LAYOUT), rank)

    def kill(self) -> None:
        """The host dies: its sidecar's tasks stop with it, nothing more is said."""

        self.alive = False
        for task in list(self.io.tasks):
            task.cancel()

    def send(self, msg: m.Msg, rank: int = 0) -> None:
        """To the sidecar's inbox (worker rank `rank`'s): in order, a little later (a busy sidecar
        reads its socket late, so a peer's claim can reach P's sidecar before P's own ticket does)."""

        world = self.world
        self.inbox_at = max(self.inbox_at + 1e-9, world.loop.time() + world.rng.uniform(0, 0.004))
        world.loop.call_at(self.inbox_at, self.deliver, m.DECODER.decode(m.ENCODER.encode(msg)), rank)

    def deliver(self, msg: m.Msg, rank: int = 0) -> None:
        if self.alive:
            self.sidecar.on_message(msg, rank)

    def each_rank(self, delay: tuple[float, float], reply, rank: int | None = None) -> None:
        """Every worker rank (or only `rank`) answers with `reply(rank)`, each after its own delay
        (`reply` runs then: what it reports is the world as the rank finds it at its end)."""

        world = self.world
        for r in range(self.ranks) if rank is None else (rank,):
            world.later(world.rng.uniform(*delay), self.reply, reply, r)

    def reply(self, reply, rank: int) -> None:
        if self.alive:
            self.send(reply(rank), rank)

    def received(self, request: str, rank: int) -> None:
        """A worker rank tells vLLM that `request`'s blocks arrived: vLLM must have parked it, and
        hears it exactly once from each rank."""

        r = self.requests.get(request)
        if r is None or not r.parked:
            self.world.violation(self, f"request {request}: finished_recving for a request vLLM did not park")
            return
        r.received[rank] += 1
        if r.received[rank] > 1:
            self.world.violation(self, f"request {request}: finished_recving twice from rank {rank}")
        if r.request is not None and all(r.received[k] for k in range(self.ranks)) \
                and r.request.status == RequestStatus().WAITING_FOR_REMOTE_KVS:
            if r.tainted and not r.invalid:
                self.world.violation(self, f"request {request}: runs on a read that ended after P let its "
                                           f"blocks go, without its blocks reported invalid")
            r.request.status = RequestStatus().RUNNING  # its blocks are in: it runs, then ends
            self.world.later(self.world.rng.uniform(0.001, 0.05), self.finish, request)

    def blocks(self, count: int) -> tuple[int, ...]:
        self.next_block += count
        return tuple(range(self.next_block - count, self.next_block))

    # -- P ---------------------------------------------------------------------------------------

    def prompt(self, request: str, num_tokens: int) -> SimpleNamespace:
        """A prompt of one of a few documents, as vLLM's scheduler hands it to the connector: its
        tokens and its full blocks' chained hashes are its document's, so prompts of one document
        share their prefixes (and history keys)."""

        document = int(hashlib.sha256(request.encode()).hexdigest(), 16) % DOCUMENTS
        hashes = [hashlib.sha256(f"doc{document}/{i}".encode()).digest()[:16] for i in range(num_tokens // BLOCK_SIZE)]
        return SimpleNamespace(request_id=request, prompt_token_ids=[document * 10_000 + i for i in range(num_tokens)],
                               block_hashes=hashes, num_computed_tokens=num_tokens, kv_transfer_params=None,
                               status=RequestStatus().WAITING, cache_salt=None, lora_request=None, mm_features=None)

    def issue(self, request: str, remote: bool = True) -> Handoff | None:
        """P prefilled `request`: the connector's request_finished issues a ticket for D to claim
        (its answer's signed section), or (`remote` False) keeps a plain prompt for history."""

        world = self.world
        num_tokens = world.rng.randint(1, 6 * BLOCK_SIZE)
        blocks = self.blocks(-(-num_tokens // BLOCK_SIZE))
        prompt = self.prompt(request, num_tokens)
        prompt.kv_transfer_params = {"do_remote_decode": True} if remote else None
        session = self.session_section(request)
        if session is not None:
            # A turn of an agent session: the scheduler side hears of the request as it arrives
            # (a resumed session's blocks move up a tier), and keeps its prompt as it finishes.
            prompt.kv_transfer_params = {**(prompt.kv_transfer_params or {}), "kvbaton_session": session}
            self.scheduler.on_new_request(prompt)
        prompt.status = RequestStatus().FINISHED_LENGTH_CAPPED
        held, params = self.scheduler.request_finished(prompt, [list(blocks)])
        if not held:
            return None
        section = (params or {}).get("kvbaton")
        ticket = section["ticket"] if section else f"retained/{request}"
        self.tickets[ticket] = (request, blocks)
        if not section:
            return None
        return Handoff(request, ticket, num_tokens, "", section["keepalive"], self, params, prompt.prompt_token_ids)

    def session_section(self, request: str) -> dict | None:
        """A third of P's prompts are a turn of their document's session: kept from a tenth of a
        second (it expires within the sequence) to a minute, resumed or first."""

        sessions = self.world.sessions
        if sessions.random() >= 0.33:
            return None
        document = int(hashlib.sha256(request.encode()).hexdigest(), 16) % DOCUMENTS
        return {"id": f"session-{document}", "keep_s": sessions.choice((0.1, 1.0, 60.0)),
                "resume": sessions.random() < 0.6}

    def ask_history(self, request: str) -> None:
        """A prompt reaches P; its scheduler side asks history for the prefix at the next step
        (a lease, restored into the request's blocks, if history keeps it)."""

        world = self.world
        prompt = self.prompt(request, world.rng.randint(1, 6) * BLOCK_SIZE)
        session = self.session_section(request)
        if session is not None:
            prompt.kv_transfer_params = {"kvbaton_session": session}
        self.requests[request] = DecodeRequest(Handoff(request, "", 0, "", "", self), request=prompt)
        self.scheduler.on_new_request(prompt)
        self.waiting.append(request)
        if world.fault("restore_abort"):  # the request goes away, before or after its lease
            world.later(world.rng.uniform(0, 0.02), self.abort, request, False)
        self.step_soon()

    def restore(self, msg: m.RestoreCopies) -> None:
        """The worker copies history slots into the request's blocks: each slot must be resident
        and pinned for the copy."""

        world = self.world
        history = self.sidecar.ledger.history
        for key, _tier, _block in msg.copies:
            blk = history.blocks.get(key)
            # (A promoting block is read from its CPU slot, which the copier keeps until then.)
            if blk is None or blk.state not in ("GPU", "CPU", "PROMOTING") or blk.pins <= 0:
                why = "gone" if blk is None else (blk.state if blk.pins > 0 else blk.state + " unpinned")
                world.violation(self, f"restore {msg.lease} copies {key} from a slot that is {why}")
        def done(rank: int) -> m.RestoreDone:
            ok = not world.fault("copy_failure")
            if ok and msg.request:  # the worker tells vLLM itself, in the step the copy ends
                self.received(msg.request, rank)
            return m.RestoreDone(msg.lease, ok, 4096 * len(msg.copies))

        self.each_rank((0.0005, 0.01), done)

    def copy(self, msg: m.Msg) -> None:
        """P's history copier: stages, demotions and promotions end a little later, some failed."""

        world = self.world
        if type(msg) is m.StageCopies:
            self.each_rank((0.0005, 0.01), lambda rank: m.StageDone(msg.ticket, not world.fault("copy_failure")))
        elif type(msg) is m.DemoteCopies:
            self.each_rank((0.0005, 0.02), lambda rank: m.DemotesDone(
                tuple((key, not world.fault("copy_failure"), "") for key in msg.keys), 0.001))
        elif type(msg) is m.PromoteCopies:
            self.each_rank((0.0005, 0.02), lambda rank: m.PromotesDone(
                tuple((key, not world.fault("copy_failure"), "") for key in msg.keys), 0.001))

    # -- D ---------------------------------------------------------------------------------------

    def arrive(self, handoff: Handoff, children: int = 1) -> None:
        """A request that carries P's handoff reaches D (with `children` > 1, vLLM's fan-out of an
        n > 1 request: children that share one handoff). The connector's scheduler side hears of
        it now and is asked about it at each engine step."""

        world = self.world
        names = [handoff.request] if children == 1 else [f"{i}_{handoff.request}" for i in range(children)]
        for rid in names:
            request = SimpleNamespace(request_id=rid, kv_transfer_params=handoff.params,
                                      prompt_token_ids=list(handoff.tokens), status=RequestStatus().WAITING,
                                      cache_salt=None, lora_request=None, mm_features=None)
            self.requests[rid] = DecodeRequest(handoff, request=request)
            self.scheduler.on_new_request(request)
            self.waiting.append(rid)
            if world.fault("abort"):
                world.later(world.rng.uniform(0, 0.5), self.abort, rid, False)
            elif world.fault("preempt"):
                world.later(world.rng.uniform(0, 0.5), self.abort, rid, True)
        self.step_soon()

    def step_soon(self) -> None:
        if not self.step_due:
            self.step_due = True
            self.world.later(self.world.rng.uniform(0, 0.02), self.step)

    def step(self) -> None:
        """One engine step of vLLM's scheduler: the connector's metadata (preemptions), then
        every waiting request asked how many tokens it can load: allocated and parked for a
        load, run (nothing to load, refused, or a sibling whose reader's blocks are cached), or
        asked again at the next step."""

        self.step_due = False
        if not self.alive:
            return
        if self.stepping:  # the step before waits for its synchronous loads
            self.step_soon()
            return
        status = RequestStatus()
        preempted, self.preempting = self.preempting, set()
        self.scheduler.build_connector_meta(SimpleNamespace(preempted_req_ids=preempted))
        for rid in list(self.waiting):
            r = self.requests[rid]
            # What vLLM's own prefix cache holds of the prompt, which may change between asks
            # (a scheduling retry): nothing, or its first block.
            tokens = len(r.request.prompt_token_ids)
            hit = self.world.rng.choice((0, 0, 0, BLOCK_SIZE)) if tokens > BLOCK_SIZE else 0
            count, load_async = self.scheduler.get_num_new_matched_tokens(r.request, hit)
            if count is None:
                continue
            self.waiting.remove(rid)
            if count > 0:
                r.blocks = self.blocks(-(-(hit + count) // BLOCK_SIZE))
                self.scheduler.update_state_after_alloc(r.request, Blocks(r.blocks), count)
                if load_async:
                    r.parked = True
                    r.request.status = status.WAITING_FOR_REMOTE_KVS
                    continue
                if not r.sync and self.scheduler.slots.get(rid) is not None and self.scheduler.slots[rid].sync:
                    r.sync = True  # it runs in this step, once its workers waited for its read
                    continue
            r.request.status = status.RUNNING
            self.world.later(self.world.rng.uniform(0.001, 0.05), self.finish, rid)
        waited = self.scheduler.take_sync_step()  # the step's metadata: what its workers wait for
        for rid, r in self.requests.items():
            if r.sync and r.request.status == status.WAITING and rid not in self.waiting and rid not in waited:
                self.world.violation(self, f"request {rid}: run synchronously with no worker waiting for its read")
        for rid in waited:
            self.stepping += 1
            self.sync_wait(rid, self.world.loop.time() + SYNC_LOAD_WAIT_S)
        if self.waiting:
            self.step_soon()

    def sync_wait(self, rid: str, deadline: float) -> None:
        """The step's workers wait for a synchronous load's read: each rank until its read ended,
        or, with none posted by `deadline`, gives the read up (then never posts it). The request
        runs on what every rank read well in its pin, or is rolled back to recompute its prompt
        (its blocks reported invalid in the step)."""

        r = self.requests[rid]
        status = RequestStatus()
        if self.world.loop.time() >= deadline + STEP_STUCK_S:
            self.world.violation(self, f"request {rid}: its step waited {STEP_STUCK_S} s past its bound for reads "
                                       f"that never ended")
            r.ended.update({rank: False for rank in range(self.ranks)})
        if self.world.loop.time() >= deadline:
            for rank in range(self.ranks):
                if rank not in r.posted and rank not in r.ended:
                    r.abandoned.add(rank)
                    r.ended[rank] = False
        if len(r.ended) < self.ranks and self.alive and not r.request.status.name.startswith("FINISHED"):
            self.world.later(0.001, self.sync_wait, rid, deadline)
            return
        self.stepping -= 1
        if r.request.status.name.startswith("FINISHED") or not self.alive:
            return
        if all(r.ended.get(rank) for rank in range(self.ranks)):
            if r.tainted:
                self.world.violation(self, f"request {rid}: runs on a synchronous read that ended after P let its "
                                           f"blocks go")
            r.request.status = status.RUNNING
            self.world.later(self.world.rng.uniform(0.001, 0.05), self.finish, rid)
        else:  # rolled back by vLLM: asked again, its handoff consumed, it recomputes
            self.waiting.append(rid)
            self.step_soon()

    def finish(self, rid: str, aborted: bool = False) -> None:
        """The request ends (done, or aborted): the connector's request_finished, once."""

        r = self.requests.get(rid)
        if r is None or r.request.status.name.startswith("FINISHED") or not self.alive:
            return
        status = RequestStatus()
        r.request.status = status.FINISHED_ABORTED if aborted else status.FINISHED_LENGTH_CAPPED
        if rid in self.waiting:
            self.waiting.remove(rid)
        held, _params = self.scheduler.request_finished(r.request, [list(r.blocks)])
        if held and self.role == "producer":  # kept for history: its blocks come back once
            self.tickets[f"retained/{rid}"] = (rid, r.blocks)

    def abort(self, rid: str, preempted: bool) -> None:
        r = self.requests.get(rid)
        if r is None or not self.alive:
            return
        if not preempted:
            r.aborted = True
            self.finish(rid, aborted=True)
            return
        # vLLM preempts only running requests: back to waiting, asked again at the next step.
        if r.request.status == RequestStatus().RUNNING:
            r.request.status = RequestStatus().WAITING
            self.preempting.add(rid)
            self.waiting.append(rid)
            self.step_soon()

    def read(self, msg: m.PostRead, rank: int | None = None) -> None:
        """The worker's read of P's blocks (every rank's, or `rank`'s when the sidecar addressed
        one): P must hold them for this ticket when it starts. A read that ends after P let the
        blocks go may have read reused memory: it taints its request, which must then not run on
        those blocks (they are reported invalid before it is received)."""

        world = self.world
        r = self.requests.get(msg.request)
        if r is not None and r.abandoned:
            ranks = range(self.ranks) if rank is None else (rank,)
            if any(k in r.abandoned for k in ranks):  # its step gave it up unposted: never posted
                for k in ranks:
                    self.send(m.ReadDone(msg.request, msg.read, False, "sync wait passed", abandoned=True), k)
                return
        if r is not None and msg.sync:
            r.posted.update(range(self.ranks) if rank is None else (rank,))
        alive = r is not None and r.handoff.source.alive
        if alive and not self.source_holds(r, msg):
            ticket = r.handoff.source.sidecar.ledger.tickets.tickets.get(r.handoff.ticket)
            world.violation(self, f"read {msg.read} of {msg.request}: P does not hold blocks "
                                  f"{msg.src_blocks} for the ticket ({ticket.state if ticket else 'none'})")
        nbytes = len(msg.dst_blocks) * 4096
        delay = (0.0005, 0.02)
        if world.fault("slow_read"):
            seconds = world.rng.uniform(*SLOW_READ_S)
            delay = (seconds, seconds + 0.01)
            if world.rng.random() < 0.5:  # and this engine's control path is cut meanwhile
                world.cut_until[self.name] = max(world.cut_until.get(self.name, 0),
                                                 world.clock.now_ns + int(seconds * SECOND_NS))

        def done(rank: int) -> m.ReadDone:
            ok = r is not None and r.handoff.source.alive and not world.fault("transport_error")
            if ok and not self.source_holds(r, msg):
                r.tainted = True
            in_pin = world.clock.now_ns <= msg.pinned_until_ns
            if r is not None and msg.sync:  # its step waits for it: nothing is reported to vLLM
                if rank not in r.ended and (not (ok and in_pin) or msg.last):
                    r.ended[rank] = ok and in_pin
            elif ok and msg.last and in_pin:  # the worker tells vLLM itself, in the step its last read ends
                self.received(msg.request, rank)
            return m.ReadDone(msg.request, msg.read, ok, "" if ok else "simulated transport error", nbytes, 0.001,
                              in_pin=in_pin)

        self.each_rank(delay, done, rank)

    def source_holds(self, r, msg: m.PostRead) -> bool:
        """P (alive) still holds the read's blocks for its ticket, with the read in flight."""

        p = r.handoff.source
        if not p.alive:
            return False
        ticket = p.sidecar.ledger.tickets.tickets.get(r.handoff.ticket)
        held = p.tickets.get(r.handoff.ticket, ("", ()))[1]
        return (ticket is not None and ticket.state in ("READING", "DRAINING") and msg.read in ticket.reads
                and not p.freed[r.handoff.request] and set(msg.src_blocks) <= set(held))

    # -- what the sidecar tells the engine ---------------------------------------------------------

    def receive(self, sock: str, msg: m.Msg, rank: int | None = None) -> None:
        """A decision for the engine: for every rank, or (`rank`) for one worker rank only."""

        if not self.alive:
            return
        world = self.world
        kind = type(msg)
        if sock == "history":
            self.copy(msg)
        elif kind is m.FinishedSending:
            self.freed[msg.request] += 1
            if self.freed[msg.request] > 1:
                world.violation(self, f"request {msg.request}: its blocks were returned twice")
        elif sock == "scheduler":
            self.scheduler.sidecar.inbox.append(msg)  # drained at the scheduler's next step
            self.step_soon()
        elif kind is m.PostRead:
            self.read(msg, rank)
        elif kind is m.RestoreCopies:
            self.restore(msg)
        elif kind is m.FinishedRecving:
            for r in range(self.ranks) if rank is None else (rank,):
                self.received(msg.request, r)
        elif kind is m.InvalidBlocks:
            r = self.requests.get(msg.request)
            if r is not None and r.sync:  # its step reported them: this would roll back its recompute
                world.violation(self, f"request {msg.request}: invalid blocks after its synchronous step")
            if r is not None:
                r.invalid = True


@dataclass
class ShellResult:
    seed: int
    events: int = 0
    violations: list[str] = field(default_factory=list)
    faults: Counter = field(default_factory=Counter)
    outcomes: Counter = field(default_factory=Counter)  # OUTCOMES, over every engine


class World:
    def __init__(self, seed: int, *, requests: int = 24, broken: str = "") -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.clock = Clock()
        self.loop = VirtualLoop(self.clock)
        self.result = ShellResult(seed)
        self.cut_until: dict[str, int] = {}  # engine -> until when its calls to peers are lost
        self.events = 0
        self.invariant_every = 16
        self.requests = requests
        # A sequence draws which faults it has; about one in four has none (the strict oracle).
        self.profile = {name: 0.0 for name in SHELL_FAULTS}
        if self.rng.random() >= 0.25:
            for name in self.rng.sample(SHELL_FAULTS, self.rng.randint(1, 3)):
                self.profile[name] = 1.0 if name.endswith("_death") else self.rng.choice((0.05, 0.15, 0.3))
        self.faultless = not any(self.profile.values())
        # P keeps history in most sequences: a few GPU slots, a CPU tier or none, 1-4 writers.
        self.history = self.rng.random() < 0.7
        block_bytes = 4096
        self.config = LedgerConfig(unclaimed_ttl_ns=3 * SECOND_NS, claim_lease_ns=2 * SECOND_NS,
                                   claim_wait_ns=2 * SECOND_NS, read_grant_wait_ns=2 * SECOND_NS,
                                   reader_silence_ns=2 * SECOND_NS, history_lease_ns=2 * SECOND_NS,
                                   retention_deadline_ns=self.rng.choice((5, 50)) * MS,
                                   block_bytes=block_bytes,
                                   gpu_history_bytes=block_bytes * self.rng.randint(4, 16) if self.history else 0,
                                   cpu_history_bytes=block_bytes * self.rng.choice((0, 8, 24)),
                                   retention_writers_max=self.rng.choice((1, 2, 4)),
                                   closed_retention_ns=60 * SECOND_NS)
        sidecar_class = SIDECAR_CLASSES[broken]
        # Tensor parallel sizes: 1 or 2 ranks per engine, so P and a D may differ (each D rank
        # then reads its share from P's ranks). Drawn apart from `rng`, whose draws set the rest.
        # Agent sessions draw apart too: which prompts name one, for how long, and resumes.
        self.sessions = random.Random(f"sessions/{seed}")
        sizes = random.Random(f"ranks/{seed}")
        ranks = {name: sizes.choice((1, 1, 2)) for name in ("P", "D0", "D1")}
        self.instances = 0
        asyncio.set_event_loop(self.loop)
        try:
            self.p = Engine(self, "P", "producer", "198.18.0.1:7000", sidecar_class, ranks["P"])
            self.ds = [Engine(self, f"D{i}", "consumer", f"198.18.0.{i + 2}:7000", sidecar_class, ranks[f"D{i}"])
                       for i in range(2)]
        finally:
            asyncio.set_event_loop(None)
        self.engines = [self.p, *self.ds]
        self.by_address = {e.address: e for e in self.engines}

    def keys(self, request: str, count: int) -> tuple[str, ...]:
        """The chained keys of a prompt's first `count` full blocks: its document's."""

        document = int(hashlib.sha256(request.encode()).hexdigest(), 16) % DOCUMENTS
        return tuple(f"doc{document}/{i}" for i in range(count))

    def fault(self, name: str) -> bool:
        hit = self.rng.random() < self.profile.get(name, 0.0)
        if hit:
            self.result.faults[name] += 1
        return hit

    def latency(self) -> float:
        return self.rng.uniform(0.0002, 0.005)

    def later(self, seconds: float, fn, *args) -> None:
        self.loop.call_later(seconds, fn, *args)

    def violation(self, engine: Engine, text: str) -> None:
        self.result.violations.append(f"{engine.name}: {text}")

    async def main(self) -> None:
        for engine in self.engines:
            engine.start()
        # A host dies at most once a sequence, somewhere in its second half.
        decode_death = self.rng.randrange(self.requests // 2, self.requests) if self.fault("decode_death") else -1
        prefill_death = self.rng.randrange(self.requests // 2, self.requests) if self.fault("prefill_death") else -1
        for i in range(self.requests):
            await asyncio.sleep(self.rng.uniform(0.001, 0.05))
            if self.p.alive:
                roll = self.rng.random()
                if self.history and roll < 0.3:
                    self.p.ask_history(f"req{i}")
                elif self.history and roll < 0.45:
                    self.p.issue(f"req{i}", remote=False)
                else:
                    d = self.rng.choice([d for d in self.ds if d.alive])
                    # Now and then an n > 1 request: vLLM's children share one handoff.
                    handoff = self.p.issue(f"req{i}")
                    children = self.rng.choice((1, 1, 1, 1, 2, 3))
                    if handoff is not None:
                        d.arrive(handoff, children)
            if i == decode_death:
                self.rng.choice(self.ds).kill()
            if i == prefill_death:
                self.p.kill()
        # The drain: every deadline (claim wait, leases, silence, unclaimed tickets) runs out.
        await asyncio.sleep(4 * self.config.unclaimed_ttl_ns / SECOND_NS + 10)

    def run(self) -> ShellResult:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.main())
            self.check_drained()
            for engine in self.engines:
                for name in OUTCOMES:
                    self.result.outcomes[name] += engine.sidecar.ledger.counters.get(f"loads.{name}", 0)
                engine.kill()
            self.loop.run_until_complete(asyncio.sleep(0))
        except Stalled as exc:
            self.result.violations.append(f"the simulation stalled: {exc}")
        finally:
            self.loop.close()
            asyncio.set_event_loop(None)
        self.result.events = self.events
        return self.result

    def check_drained(self) -> None:
        for engine in self.engines:
            if not engine.alive:
                continue
            a = engine.sidecar
            ledger = a.ledger
            for text in ledger.check_invariants():
                self.violation(engine, text)
            for text in engine.auditor.leaks():
                self.violation(engine, f"after the drain: {text}")
            # vLLM waits for exactly one finished_recving for each request it parked (a load on
            # D, a restore on P), aborted or not.
            for rid, r in engine.requests.items():
                told = [r.received[rank] for rank in range(engine.ranks)]
                if r.parked and told != [1] * engine.ranks:
                    self.violation(engine, f"request {rid}: parked, told received {told} times by its ranks")
            # Every request ended (vLLM called request_finished) and the scheduler side forgot it:
            # no slot, no reader left.
            unfinished = [rid for rid, r in engine.requests.items()
                          if not r.request.status.name.startswith("FINISHED")]
            if unfinished:
                self.violation(engine, f"after the drain: requests never finished {unfinished[:4]}")
            side = engine.scheduler
            if side.slots or side.readers or side.errors:
                self.violation(engine, f"after the drain: scheduler slots {list(side.slots)[:4]}, readers "
                                       f"{list(side.readers)[:4]}, {side.errors} connector errors")
            lingering = [task for task in engine.io.tasks
                         if task.get_coro().__name__ not in ("timer_loop", "heartbeat_loop")]
            if lingering:
                names = sorted(Counter(task.get_coro().__name__ for task in lingering).items())
                self.violation(engine, f"after the drain: shell tasks still running {names}")
            if engine is self.p:
                for ticket, (request, _blocks) in engine.tickets.items():
                    if engine.freed[request] != 1:
                        self.violation(engine, f"ticket {ticket}: blocks of {request} returned "
                                               f"{engine.freed[request]} times")
                    record = ledger.tickets.tickets.get(ticket)
                    if self.faultless and record is not None and record.close_reason != "released":
                        self.violation(engine, f"ticket {ticket} closed as '{record.close_reason}' without any fault")
            else:
                for rid in engine.requests:
                    load = ledger.loads.loads.get(rid)
                    if self.faultless and load is not None and load.state != "DONE":
                        self.violation(engine, f"load {rid} ended {load.state} ({load.outcome}) without any fault")


def run_shell_fuzz(seed: int = 1, sequences: int = 100, broken: str = "", stop_after_failures: int = 1,
                   progress=None) -> dict:
    """Run seeded sequences on the real shell; a report dict (sequences, events, failures, faults)."""

    if broken and broken not in BREAKS:
        raise ValueError(f"--break must be one of {', '.join(BREAKS)}")
    # The shell logs every refused call and lost peer, as it should in an engine: here they are
    # the faults the run injects on purpose.
    sidecar_log = logging.getLogger("kvbaton.sidecar")
    level = sidecar_log.level
    sidecar_log.setLevel(logging.CRITICAL)
    try:
        return _run(seed, sequences, broken, stop_after_failures, progress)
    finally:
        sidecar_log.setLevel(level)


def _run(seed: int, sequences: int, broken: str, stop_after_failures: int, progress) -> dict:
    report = {"sequences": 0, "events": 0, "violations": 0, "faults": Counter(), "outcomes": Counter(),
              "failures": []}
    for index in range(sequences):
        result = World(seed * 1_000_003 + index, broken=broken).run()
        report["sequences"] += 1
        report["events"] += result.events
        report["faults"].update(result.faults)
        report["outcomes"].update(result.outcomes)
        if result.violations:
            report["violations"] += 1
            report["failures"].append({"seed": result.seed, "index": index, "first": result.violations[:3]})
            if len(report["failures"]) >= stop_after_failures:
                break
        if progress is not None:
            progress(1)
    report["faults"] = {name: report["faults"].get(name, 0) for name in SHELL_FAULTS}
    report["outcomes"] = {name: report["outcomes"].get(name, 0) for name in OUTCOMES}
    return report
