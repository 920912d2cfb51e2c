"""The sidecar's calls to peers (D side): claims, read starts and ends, releases, heartbeats to the
prefill engines a decode engine loads from. `PeerClient` is a part of `Sidecar` (sidecar.py): it
keeps what only calls need (connections, the P instance behind each ticket, the peers announced to
the worker, each load's keepalive) and hands every answer to the sidecar's ledger as an event."""

from __future__ import annotations

import collections
import logging


import msgspec

from ..core import effects as fx
from ..core import events as ev
from ..core import load as loads
from ..core.reasons import Reason
from . import messages as m
from . import peer as pc
from .ranks import read_plan, unpack_metadata
from .client import bounded
from .io import WORKER

logger = logging.getLogger("kvbaton.sidecar")

STALE_SOURCE = Reason.SOURCE_RESTARTED.detail("the ticket was issued by an earlier instance of P")
# How long D keeps asking while P answers "unknown ticket" (within the claim wait).
UNKNOWN_TICKET_RETRY_S = 8.0
# Control addresses a decode engine keeps connections to: one per prefill engine it reads from,
# far more than a deployment has.
MAX_PEERS = 256
HEARTBEAT_RECHECK_S = 1.0
MIN_HEARTBEAT_NS = 10_000_000


class PeerClient:
    """What a decode engine's sidecar asks of prefill engines."""

    def __init__(self, sidecar) -> None:
        self.sidecar = sidecar
        self.cfg = sidecar.cfg
        self.io = sidecar.io
        self.ledger = sidecar.ledger
        # The instance of the P that issued each ticket this engine loads (calls are addressed).
        self.ticket_instances: collections.OrderedDict[str, str] = collections.OrderedDict()
        # The one thing about a load only the shell holds (the core never sees a secret): the
        # keepalive its heartbeats present to P, by request, until the load finishes.
        self.keepalives: dict[str, str] = {}
        # Connections to the peers it calls, least recently called first (`ref`).
        self.peer_refs: collections.OrderedDict[str, object] = collections.OrderedDict()
        # NIXL peers announced to the worker, by (control address, engine id, instance) as P's
        # grants and metadata answers named them (never as a client's request named them).
        self.peers_announced: set[tuple[str, str, str]] = set()
        # For a source engine of another tensor parallel size, the transport peers each of this
        # engine's ranks reads it through (one per source rank it reads: `announce_peer`).
        self.read_sources: dict[str, list[tuple[str, ...]]] = {}
        # `kv_checksums`: P's sums of each granted read's ticket, per P rank, until it is posted.
        self.read_sums: dict[str, tuple[tuple[int, ...], ...]] = {}

    def load_requested(self, request: str, ticket: str, source_instance: str, keepalive: str) -> None:
        """A new load: calls about its ticket, even after the load is pruned, are addressed to
        the P instance that issued it; its heartbeats present `keepalive`."""

        self.ticket_instances[ticket] = source_instance
        while len(self.ticket_instances) > 65536:
            self.ticket_instances.popitem(last=False)
        self.keepalives[request] = keepalive

    def load_ended(self, request: str) -> None:
        self.keepalives.pop(request, None)

    def carry(self, effect) -> None:
        """Start the call an effect asks for."""

        kind = type(effect)
        cfg, spawn = self.cfg, self.io.spawn
        if kind is fx.SendClaim:
            spawn(self.claim(effect))
        elif kind is fx.SendReadStart:
            spawn(self.read_start(effect))
        elif kind is fx.PostRead:
            spawn(self.post_read(effect))
        elif kind is fx.SendReadEnd:
            spawn(self.read_end(effect))
        elif kind is fx.SendRelease:
            spawn(self.call(effect.source, pc.Release(effect.ticket, cfg.engine_id, effect.epoch),
                            self.issuer(effect.ticket, effect.request)))

    async def read_end(self, effect: fx.SendReadEnd) -> None:
        """Tell P a read ended. P answers whether it still held the read's blocks. A read to
        confirm (it ended past its pin) counts only on a "held" answer: the answer goes to the
        core, and a read P had let go of is counted (`read_unpinned`) and recomputed. A read that
        ended within its pin was P's throughout, so P answering otherwise means a broken clock
        or bound: logged as an error naming the request."""

        issuer = self.issuer(effect.ticket, effect.request)
        answer = await self.call(effect.source, pc.ReadEnd(effect.ticket, self.cfg.engine_id, effect.epoch,
                                                           effect.read, effect.ok, effect.release), issuer)
        if answer is None and effect.release:
            # The release rode on the failed call: send it alone (idempotent at P), or P keeps the
            # ticket until its reader's silence ends it.
            self.io.spawn(self.call(effect.source, pc.Release(effect.ticket, self.cfg.engine_id, effect.epoch), issuer))
        held = answer is not None and answer.ok
        if effect.confirm:
            reason = "" if held else (answer.reason if answer is not None else Reason.SOURCE_UNREACHABLE)
            effects = self.sidecar.apply(ev.ReadEndAnswered(self.io.now_ns(), effect.request, effect.read, held,
                                                            reason))
            if not held and any(type(e) is fx.LoadFinished for e in effects):  # not for a load already over
                self.sidecar.refused["read_unpinned"] += 1
                self.sidecar.refusal_log.warning(
                    "read_unpinned", "request %s: read %s ended past its pin and P at %s did not confirm "
                    "it still held the blocks (%s); they are recomputed", effect.request, effect.read,
                    effect.source, reason)
        elif effect.counted and answer is not None and not held and answer.reason == Reason.UNKNOWN_READ:
            self.sidecar.refused["pin_violated"] += 1
            logger.error("request %s: P at %s no longer held read %s, which ended here within its pin: the "
                         "engines' clocks or P's silent-reader bound are broken; its KV may be wrong",
                         effect.request, effect.source, effect.read)

    async def heartbeat_loop(self) -> None:
        last = self.io.now_ns()
        while True:
            # The interval is read afresh at least every HEARTBEAT_RECHECK_S: a changed test hook
            # takes effect within that, not after a long interval already begun.
            interval_ns = max(MIN_HEARTBEAT_NS, int((self.sidecar.hooks.heartbeat_interval_s
                                                      or self.cfg.heartbeat_interval_s) * 1e9))
            left_ns = last + interval_ns - self.io.now_ns()
            if left_ns > 0:
                await self.io.sleep(min(left_ns / 1e9, HEARTBEAT_RECHECK_S))
                continue
            last = self.io.now_ns()
            by_source: dict[tuple[str, str], list[pc.HeartbeatTicket]] = {}
            for load in self.ledger.loads.loads.values():
                if load.state not in loads.SPEC.terminal:
                    by_source.setdefault((load.source, self.issuer(load.ticket, load.request)), []).append(
                        pc.HeartbeatTicket(load.ticket, self.keepalives.get(load.request, "")))
            for (source, instance), tickets in by_source.items():
                for lo in range(0, len(tickets), pc.MAX_HEARTBEAT_TICKETS):
                    self.io.spawn(self.call(source, pc.Heartbeat(
                        self.cfg.engine_id, tickets[lo:lo + pc.MAX_HEARTBEAT_TICKETS], self.sidecar.instance,
                        self.sidecar.address, self.sidecar.started_ns), instance))

    def issuer(self, ticket: str, request: str = "") -> str:
        """The instance of the P that issued `ticket`: calls about it are addressed to it (the
        load's own record first; the bounded book by ticket for calls after the load ended)."""

        load = self.ledger.loads.loads.get(request) if request else None
        if load is not None and load.ticket == ticket and load.source_instance:
            return load.source_instance
        return self.ticket_instances.get(ticket, "")

    # -- calls to peers (D side) -------------------------------------------------------------------

    async def ref(self, address: str):
        ref = self.peer_refs.get(address)
        if ref is None:
            # A bounded set of peers, the least recently called let go first: a connection per
            # address ever dialled would otherwise stay open for the engine's lifetime.
            while len(self.peer_refs) >= MAX_PEERS:
                oldest = next(iter(self.peer_refs))
                self.peer_refs.pop(oldest)
                self.sidecar.refused["peer_evicted"] += 1
                await self.io.disconnect(oldest)
            ref = await self.io.connect(address)
            self.peer_refs[address] = ref
        else:
            self.peer_refs.move_to_end(address)
        return ref

    async def try_call(self, address: str, call: pc.PeerCall, to: str = "") -> tuple[str, object]:
        """Call a peer's sidecar: `("ok", answer)`, `("refused", exc)` when the call provably
        never reached it (nobody listens at the address yet, or its pool is up but its sidecar
        is not created yet), or `("failed", exc)` for any other failure (it may have got it).
        The answer is decoded as the typed answer of `call`; anything else is a failure."""

        what = call.__struct_config__.tag
        try:
            # Bounded: a peer that is stopped or wedged (or whose port another program took)
            # never answers, and xoscar would wait for it forever. A timeout may have reached it.
            ref = await bounded(self.ref(address), self.cfg.call_timeout_s, f"connect to {address}")
            answer = pc.ask(ref, call, to=to, sender=self.cfg.engine_id, now_ns=self.io.wall_ns())
            return "ok", await bounded(answer, self.cfg.call_timeout_s, f"{what} at {address}")
        except Exception as exc:
            # A peer that failed a call loses its connection too: the next call dials afresh
            # (a restarted peer, or one that moved), and a dead one holds no descriptor here.
            self.peer_refs.pop(address, None)
            await self.io.disconnect(address)
            return ("refused" if _never_arrived(exc) else "failed"), exc

    async def call(self, address: str, call: pc.PeerCall, to: str = ""):
        """A peer's answer, or None when the call failed (logged). `to`: the peer's instance."""

        status, value = await self.try_call(address, call, to)
        if status == "ok":
            return value
        logger.warning("call %s to %s failed: %r", call.__struct_config__.tag, address, value)
        return None

    def claim_retry_deadline(self) -> float:
        """When a claim stops retrying (this process's monotonic seconds): as long as the load
        waits for its claim, no longer."""

        return self.io.now_ns() / 1e9 + self.cfg.ledger.claim_wait_ns / 1e9

    def awaiting_claim(self, effect: fx.SendClaim) -> bool:
        """The load this claim is for still waits for P's answer (allocated already or not)."""

        load = self.ledger.loads.loads.get(effect.request)
        return (load is not None and load.state in loads.AWAITING_ANSWER and load.ticket == effect.ticket
                and load.epoch == effect.epoch)

    async def claim(self, effect: fx.SendClaim) -> None:
        if self.sidecar.hooks.delay_claim_s:
            await self.io.sleep(self.sidecar.hooks.delay_claim_s)
        # Just after an engine starts (its sidecar comes up a while after vLLM reports ready: a
        # second or two on a warm GPU machine, minutes on a loaded CPU one), or just after P
        # finished the prefill (its fact may still be on the way to its sidecar), a claim can
        # find nobody listening or an unknown ticket. Both are retried with backoff for as long
        # as the load waits for its claim (the ledger's `claim_wait_ns`, after which it misses
        # anyway), and only those: any other failure may have reached P, so it is a miss at
        # once. A claim is idempotent for the same (claimer, epoch). At most one call per 0.5 s
        # per waiting load once the backoff has grown; the retries stop as soon as the load no
        # longer waits (expired, aborted) or the sidecar stops.
        deadline = self.claim_retry_deadline()
        pause = 0.02
        retried = 0
        unknown_since = None
        call = pc.Claim(effect.ticket, self.cfg.engine_id, effect.epoch, self.sidecar.instance, self.sidecar.address,
                        self.sidecar.started_ns)
        expected_instance = self.issuer(effect.ticket, effect.request)
        while True:
            status, value = await self.try_call(effect.source, call, self.issuer(effect.ticket, effect.request))
            reply = value if status == "ok" else None
            if reply is not None and not reply.granted and (
                    reply.reason == pc.MISADDRESSED_ANSWER
                    or (expected_instance and reply.instance and reply.instance != expected_instance)):
                # The sidecar at this address is not the instance that issued the ticket: P
                # restarted (its tickets died with the old instance). A miss at once, never the
                # unknown-ticket retries. (A grant from another instance is the core's to refuse.)
                reply = pc.ClaimAnswer(False, STALE_SOURCE, instance=reply.instance)
                self.sidecar.refused["stale_instance"] += 1
                break
            unknown = reply is not None and not reply.granted and reply.reason == Reason.UNKNOWN_TICKET
            if unknown and unknown_since is None:
                unknown_since = self.io.now_ns() / 1e9
            # "Unknown ticket" is a race with P's own fact (milliseconds; seconds on a starved
            # machine), not a reason to hold D's blocks for the whole claim wait: a restarted P,
            # or one that pruned the ticket, never learns it.
            retry = status == "refused" or (unknown and self.io.now_ns() / 1e9 - unknown_since < UNKNOWN_TICKET_RETRY_S)
            if not retry:
                if status == "failed":
                    logger.warning("claim of ticket %s at %s failed: %r", pc.short(effect.ticket),
                                   effect.source, value)
                break
            if self.sidecar.stopping or not self.awaiting_claim(effect):
                return  # the load already ended (it resolved itself); P never took this claim
            left = deadline - self.io.now_ns() / 1e9
            if left <= 0:  # the ledger has normally expired the load already ("claim unanswered")
                logger.warning("claim of ticket %s at %s: still %s after %d retries; giving up",
                               pc.short(effect.ticket), effect.source,
                               "refused" if status == "refused" else "unknown", retried)
                break
            if retried == 0:
                logger.info("claim of ticket %s at %s: %s; retrying for up to %.1f s", pc.short(effect.ticket),
                            effect.source, repr(value) if status == "refused" else "unknown ticket", left)
            await self.io.sleep(min(pause, left))
            pause = min(pause * 2, 0.5)
            retried += 1
        now = self.io.now_ns()
        if reply is not None and reply.granted:
            # What P granted goes to the core as it came: the load machine decides whether it may
            # be read (core.load.grant_problem), and gives the ticket back when not.
            effects = self.sidecar.apply(ev.ClaimGranted(now, effect.request, effect.ticket, effect.epoch, reply.engine,
                                                  reply.instance, tuple(reply.blocks), reply.num_tokens,
                                                  reply.digest, reply.layout))
            if _forgotten(effects):  # the load was pruned meanwhile: give the ticket back
                self.io.spawn(self.call(effect.source, pc.Release(effect.ticket, self.cfg.engine_id,
                                                                 effect.epoch), self.issuer(effect.ticket, effect.request)))
            for refusal in (e for e in effects if type(e) is fx.LoadResolved and not e.hit):
                key = "stale_instance" if Reason.head(refusal.reason) == Reason.SOURCE_RESTARTED else "grant_mismatch"
                self.sidecar.refused[key] += 1
                self.sidecar.refusal_log.warning(key, "request %s: %s (P at %s); recomputing",
                                         effect.request, refusal.reason, effect.source)
        else:
            reason = reply.reason if reply is not None else Reason.SOURCE_UNREACHABLE
            self.sidecar.apply(ev.ClaimRefused(now, effect.request, effect.ticket, effect.epoch, reason))
            if status == "failed":
                # The call may have reached P and been granted there: give the ticket back rather
                # than leave P's blocks claimed for a whole idle lease.
                self.io.spawn(self.call(effect.source, pc.Release(effect.ticket, self.cfg.engine_id,
                                                                 effect.epoch), self.issuer(effect.ticket, effect.request)))

    async def announce_peer(self, source: str, engine: str, instance: str) -> bool:
        """Give the worker P's transport metadata once per (address, engine, instance); the
        metadata must come from the engine and instance the grant named. A new instance's
        metadata replaces the old one's (the worker drops the old NIXL agent first)."""

        if (source, engine, instance) in self.peers_announced:
            return True
        answer = await self.call(source, pc.Metadata(), instance)
        if answer is None or answer.metadata is None:
            return False
        if answer.engine != engine or answer.instance != instance:
            self.sidecar.refused["metadata_mismatch"] += 1
            self.sidecar.refusal_log.warning("metadata_mismatch", "peer at %s granted as engine %r instance %s "
                                     "answers as %r instance %s: not reading from it", source, engine,
                                     instance[:8], answer.engine, answer.instance[:8])
            return False
        per_rank = unpack_metadata(answer.metadata)
        plan = None if per_rank is None else read_plan(len(per_rank), self.cfg.ranks)
        if plan is None:
            self.sidecar.refused["metadata_mismatch"] += 1
            self.sidecar.refusal_log.warning("metadata_mismatch", "peer at %s (engine %r) sent transport metadata "
                                     "for %s ranks, this engine has %d: not reading from it", source, engine,
                                     "unreadable" if per_rank is None else len(per_rank), self.cfg.ranks)
            return False
        if len(per_rank) == self.cfg.ranks:  # each rank reads its counterpart's shard, whole
            for rank, metadata in enumerate(per_rank):
                self.io.send(WORKER, rank=rank, msg=m.AddPeer(engine, metadata))
            self.read_sources.pop(engine, None)
        else:  # each rank reads its heads from the source ranks that hold them (ranks.read_plan)
            sources = []
            for rank, reads in enumerate(plan):
                sources.append(tuple(f"{engine}#{source_rank}" for source_rank, _, _ in reads))
                for (source_rank, remote_slice, local_slice), peer in zip(reads, sources[-1]):
                    self.io.send(WORKER, rank=rank, msg=m.AddPeer(engine, per_rank[source_rank], peer,
                                                                    remote_slice, local_slice))
            self.read_sources[engine] = sources
        self.peers_announced = {key for key in self.peers_announced if key[:2] != (source, engine)}
        self.peers_announced.add((source, engine, instance))
        return True

    async def read_start(self, effect: fx.SendReadStart) -> None:
        if effect.read.endswith("/0") and self.sidecar.hooks.hold_first_read_s:
            await self.io.sleep(self.sidecar.hooks.hold_first_read_s)
        elif not effect.read.endswith("/0") and self.sidecar.hooks.pause_between_reads_s:
            await self.io.sleep(self.sidecar.hooks.pause_between_reads_s)
        if effect.engine and not await self.announce_peer(effect.source, effect.engine, effect.instance):
            self.sidecar.apply(ev.ReadRefused(self.io.now_ns(), effect.request, effect.read, Reason.NO_TRANSPORT_METADATA))
            return
        asked = self.io.now_ns()  # P's bound on the read starts after this (ReadGranted)
        reply = await self.call(effect.source, pc.ReadStart(effect.ticket, self.cfg.engine_id,
                                                             effect.epoch, effect.read), self.issuer(effect.ticket, effect.request))
        now = self.io.now_ns()
        if reply is not None and reply.ok:
            self.read_sums.pop(effect.read, None)
            if self.cfg.checksums and reply.sums:
                self.read_sums[effect.read] = reply.sums
            effects = self.sidecar.apply(ev.ReadGranted(now, effect.request, effect.read, asked, reply.pinned_ns))
            if not any(type(e) is fx.PostRead and e.read == effect.read for e in effects):
                self.read_sums.pop(effect.read, None)  # nothing will be posted for this grant
            if _forgotten(effects):
                # The load was pruned meanwhile: nobody will end the read P pinned for; end it.
                self.io.spawn(self.call(effect.source, pc.ReadEnd(effect.ticket, self.cfg.engine_id,
                                                                 effect.epoch, effect.read, False, True),
                                       self.issuer(effect.ticket, effect.request)))
        else:
            reason = reply.reason if reply is not None else Reason.SOURCE_UNREACHABLE
            self.sidecar.apply(ev.ReadRefused(now, effect.request, effect.read, reason))

    async def post_read(self, effect: fx.PostRead) -> None:
        if self.sidecar.hooks.hold_post_s:
            await self.io.sleep(self.sidecar.hooks.hold_post_s)
        post = m.PostRead(effect.request, effect.read, effect.engine, effect.src, effect.dst, effect.last,
                          pinned_until_ns=effect.pinned_until_ns, sync=effect.sync)
        sources = self.read_sources.get(effect.engine)
        sums = self.read_sums.pop(effect.read, ())
        if self.cfg.checksums and not self.sidecar.hooks.unchecked_reads:
            per_rank = self.rank_sums(effect, sums) if sources is None else None
            if per_rank is None:
                self.sidecar.checksums["unverified"] += 1
            else:  # each rank checks its share of the blocks against its counterpart's sums
                for rank, rank_sums in enumerate(per_rank):
                    self.io.send(WORKER, rank=rank, msg=msgspec.structs.replace(post, sums=rank_sums))
                return
        if sources is None:  # a source of this engine's size: every rank reads its counterpart
            self.io.send(WORKER, post)
        else:  # each rank reads its heads from the source ranks that hold them
            for rank, peers in enumerate(sources):
                self.io.send(WORKER, rank=rank, msg=msgspec.structs.replace(post, peers=peers))


    def rank_sums(self, effect: fx.PostRead, sums: tuple) -> list[tuple[int, ...]] | None:
        """P's sums of this read's source blocks for each of this engine's ranks (P's rank r's
        for rank r), or None when they cannot be matched to the read (none given, another rank
        count, or blocks P did not grant)."""

        load = self.ledger.loads.loads.get(effect.request)
        if not sums or load is None or len(sums) != self.cfg.ranks:
            return None
        index = {block: i for i, block in enumerate(load.granted)}
        if any(len(rank) != len(load.granted) for rank in sums) or any(b not in index for b in effect.src):
            return None
        return [tuple(rank[index[block]] for block in effect.src) for rank in sums]


def _forgotten(effects: list) -> bool:
    """The ledger no longer knows the load a grant is for (pruned): the grant must be undone."""

    return any(type(e) is fx.Rejected and e.reason == Reason.UNKNOWN_LOAD for e in effects)


def _never_arrived(exc: BaseException) -> bool:
    """True when a failed call provably never reached the peer's sidecar: the connection was
    refused (nobody listens at the address), or the peer's pool answered that no such actor
    exists (the pool is up, the sidecar not yet created). Follows explicit wrapping
    (`raise ... from exc`), never an exception merely raised while handling another."""

    try:
        from xoscar.errors import ActorNotExist
    except ImportError:  # a simulated network has no pools
        ActorNotExist = ConnectionRefusedError
    for _ in range(8):
        if isinstance(exc, (ConnectionRefusedError, ActorNotExist)):
            return True
        if exc.__cause__ is None:
            return False
        exc = exc.__cause__
    return False
