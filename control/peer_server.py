"""The sidecar's answers to peers (P side): the one door (`answer_frame`), its typed requests
checked and turned into ledger events, refusals counted and logged. `PeerServer` is a part of
`Sidecar` (sidecar.py): it keeps what only answers need (the replay window, the decode engines'
instances) and applies every request to the sidecar's ledger as an event."""

from __future__ import annotations

import collections
import logging

import msgspec

from ..core import effects as fx
from ..core import events as ev
from ..core import ticket as tickets
from ..core.reasons import Reason
from . import peer as pc
from . import router_door as rd
from .guard import capability_digest, peer_address

logger = logging.getLogger("kvbaton.sidecar")

# A call from an instance that started before the one P knows at that address is refused while
# that one was heard within this long (twice the freshness window).
OLDER_INSTANCE_HEARD_NS = 2 * pc.FRESH_WINDOW_NS

# Ledger refusals that say who asked was not allowed (counted as peers.refused.<reason>).
_OWNER_REFUSALS = {Reason.NOT_CLAIMER: "not_claimer", Reason.NO_CAPABILITY: "no_capability"}


class PeerServer:
    """How a prefill engine's sidecar answers its peers."""

    def __init__(self, sidecar) -> None:
        self.sidecar = sidecar
        self.cfg = sidecar.cfg
        self.io = sidecar.io
        self.ledger = sidecar.ledger
        # The nonces of the peer calls answered lately: a call that is not fresh is refused.
        self.replay_window = pc.ReplayWindow()
        # The instance last heard from each decode engine at each control address ((address,
        # claimer) -> (started_ns, instance, last heard)): the same engine at the same address with
        # an instance that started later restarted.
        self.peer_instances: collections.OrderedDict[tuple[str, str], tuple[int, str, int]] = collections.OrderedDict()

    def refuse(self, reason: str, detail: str) -> None:
        """A peer's call refused before (or by) the ledger: counted and logged, rate-limited."""

        self.sidecar.refused[reason] += 1
        self.sidecar.refusal_log.warning(reason, "refused a peer call from %s (%s): %s", peer_address.get(),
                                         reason, detail)

    def answer_frame(self, payload) -> bytes:
        """A peer's authenticated frame in, the encoded answer out: the one door peers have."""

        try:
            envelope = pc.decode_call(payload)
        except pc.PeerRefusal as refusal:
            self.refuse(refusal.reason, refusal.detail)
            return pc.ENCODER.encode(pc.Answer(False, pc.REFUSED + refusal.reason))
        request = envelope.call
        wall = self.io.wall_ns()
        stale = self.replay_window.refusal(envelope, self.sidecar.instance, wall)
        if stale is not None:
            self.refuse(stale, f"{request.__struct_config__.tag} from {envelope.sender!r} for instance "
                               f"{envelope.to[:8] or '(none)'}, sent {(wall - envelope.sent_ns) / 1e9:.1f} s ago")
            return pc.ENCODER.encode(pc.Answer(False, pc.REFUSED + stale))
        try:
            answer = self.answer(request)
        except Exception:  # a bug must not take the sidecar down, nor leak its text to the peer
            logger.exception("answering a peer's %s failed", request.__struct_config__.tag)
            self.sidecar.refused["internal_error"] += 1
            answer = pc.ClaimAnswer(False, "internal error") if type(request) is pc.Claim else \
                pc.Answer(False, "internal error")
        return pc.ENCODER.encode(answer)

    def answer_router(self, body: bytes, mac: str) -> tuple[str, bytes, str]:
        """The router's door (router_door.py): (HTTP status, answer, its tag). The tag is checked
        before a byte is decoded; only Abandon, State, Residency and Session decode."""

        key = self.sidecar.router_key
        if not key or not rd.same_tag(rd.tag(key, b"call", body), mac):
            self.refuse("router_unauthenticated", f"a {len(body)}-byte call without the router key's tag")
            return "403 Forbidden", b"", ""
        try:
            envelope = rd.DECODER.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self.refuse("router_invalid", str(exc)[:200])
            return "400 Bad Request", b"", ""
        wall = self.io.wall_ns()
        stale = self.replay_window.refusal(envelope, self.sidecar.instance, wall)
        if stale is not None:
            self.refuse(stale, f"router's {envelope.call.__struct_config__.tag} for instance "
                               f"{envelope.to[:8] or '(none)'}, sent {(wall - envelope.sent_ns) / 1e9:.1f} s ago")
            answer = pc.Answer(False, pc.REFUSED + stale)
        else:
            try:
                answer = self.answer(envelope.call)
            except Exception:  # a bug must not take the sidecar down, nor leak its text
                logger.exception("answering the router's %s failed", envelope.call.__struct_config__.tag)
                self.sidecar.refused["internal_error"] += 1
                answer = pc.Answer(False, "internal error")
        out = pc.ENCODER.encode(answer)
        return "200 OK", out, rd.answer_tag(key, envelope.nonce, out)

    def refused_by_ledger(self, effects: list, request: pc.PeerCall) -> fx.Rejected | None:
        """A peer's request the ledger refused for who asked (not the claimer, no capability,
        claimed by another): counted and logged like the gate's refusals. Refusals of state
        (closed, unknown read) are lifecycle races, counted by the ledger only."""

        refused = _reply(effects, fx.Rejected)
        if refused is not None:
            reason = _OWNER_REFUSALS.get(refused.reason)
            if reason is not None:
                self.refuse(reason, f"{request.__struct_config__.tag} of ticket {pc.short(refused.subject)} "
                                     f"by {getattr(request, 'claimer', '?')!r}")
        return refused

    def note_peer(self, request: pc.Claim | pc.Heartbeat, now: int) -> bool:
        """Decode engine `request.claimer` at `request.address` speaks as `request.instance`,
        started at `request.started_ns`. False (counted: `older_instance`) when this engine at
        this address was heard from as an instance that started later: an older instance's call
        (a replay, or a process that should be gone) changes nothing. When it is a newer
        instance, the older one restarted: its claims without a read in flight end now (P's
        blocks come back on the normal path) instead of when their idle lease runs out; its
        reads in flight end by their bound, never because a newer instance spoke. Two engines
        that report one address (a wildcard or a copied port) are told apart by their names and
        never end each other's claims."""

        address, instance, claimer = request.address, request.instance, request.claimer
        if not address or not instance or address.rpartition(":")[0] in ("0.0.0.0", "[::]", "::", ""):
            return True
        key = (address, claimer)
        known = self.peer_instances.get(key)
        if (known is not None and known[1] != instance and request.started_ns <= known[0]
                and now - known[2] < OLDER_INSTANCE_HEARD_NS):
            # (An instance P has not heard for a while is gone whatever its start said: a restarted
            # engine whose clock stepped back is locked out for that long at most.)
            self.refuse("older_instance", f"{request.__struct_config__.tag} from {claimer!r} at {address} as "
                                           f"instance {instance[:8]}, which started before instance {known[1][:8]}")
            return False
        if known is not None and known[1] == instance:
            self.peer_instances[key] = (known[0], instance, now)
            self.peer_instances.move_to_end(key)
            return True
        self.peer_instances[key] = (request.started_ns, instance, now)
        self.peer_instances.move_to_end(key)
        while len(self.peer_instances) > 4096:
            self.peer_instances.popitem(last=False)
        if known is None:
            return True
        # Heard first from the newer instance, so every claim this engine name holds here is the
        # older instance's (the newer one has claimed nothing yet).
        ended = reading = 0
        for ticket in list(self.ledger.tickets.tickets.values()):
            if ticket.claimer != claimer or ticket.state not in (tickets.CLAIMED, tickets.READING):
                continue
            if ticket.reads:
                reading += 1
                continue
            self.sidecar.apply(ev.ReleaseRequested(now, ticket.ticket, ticket.claimer, ticket.epoch))
            ended += 1
        self.sidecar.refusal_log.warning("peer_restarted", "decode engine at %s restarted (instance %s, was %s): "
                                 "ended %d of its earlier instance's claims; %d with reads in flight end "
                                 "by their read bound", address, instance[:8], known[1][:8], ended, reading)
        return True

    def answer(self, request: pc.PeerCall):
        now = self.io.now_ns()
        kind = type(request)
        if kind is pc.Claim:
            if not self.note_peer(request, now):
                return pc.ClaimAnswer(False, pc.REFUSED + "older_instance", instance=self.sidecar.instance)
            reply = _reply(self.sidecar.apply(ev.ClaimRequested(now, request.ticket, request.claimer,
                                                              request.epoch)), fx.ReplyClaim)
            if reply is None:
                return pc.ClaimAnswer(False, "no reply", instance=self.sidecar.instance)
            if not reply.granted:
                if reply.reason == Reason.CLAIMED_BY_ANOTHER:
                    self.refuse("not_claimer", f"claim of ticket {pc.short(request.ticket)} claimed by "
                                                f"another, by {request.claimer!r}")
                if reply.reason == Reason.UNKNOWN_TICKET:
                    self.sidecar.refusal_log.warning("unknown_ticket", "claim of unknown ticket %s by %r from %s",
                                             pc.short(request.ticket), request.claimer, peer_address.get())
                return pc.ClaimAnswer(False, reply.reason, instance=self.sidecar.instance)
            return pc.ClaimAnswer(True, reply.reason, self.cfg.engine_id, self.cfg.layout, reply.blocks,
                                  reply.num_tokens, reply.digest, self.sidecar.instance)
        if kind is pc.ReadStart:
            effects = self.sidecar.apply(ev.ReadStarted(now, request.ticket, request.claimer, request.epoch,
                                                 request.read))
            self.refused_by_ledger(effects, request)
            reply = _reply(effects, fx.ReplyRead)
            if reply is None:
                return pc.Answer(False, "no reply")
            if not reply.granted:
                return pc.Answer(False, reply.reason)
            return pc.Answer(True, reply.reason, reply.pinned_ns, self.sidecar.ticket_sums(request.ticket))
        if kind is pc.ReadEnd:
            # The answer says whether this engine still held the read's blocks: the reader counts
            # a read that ended past its pin only when it did (core.load CONFIRMING).
            effects = self.sidecar.apply(ev.ReadFinished(now, request.ticket, request.read, request.ok,
                                                  request.claimer, request.epoch))
            refused = self.refused_by_ledger(effects, request)
            held = _reply(effects, fx.ReplyReadEnd)
            if refused is not None and refused.reason == Reason.NOT_CLAIMER:
                return pc.Answer(False, refused.reason)
            if request.release:
                self.sidecar.apply(ev.ReleaseRequested(now, request.ticket, request.claimer, request.epoch))
            if held is None:
                return pc.Answer(False, "no reply")
            return pc.Answer(held.held, held.reason)
        if kind is pc.Release:
            refused = self.refused_by_ledger(self.sidecar.apply(ev.ReleaseRequested(
                now, request.ticket, request.claimer, request.epoch)), request)
            return pc.Answer(refused is None, refused.reason if refused is not None else "")
        if kind is pc.Heartbeat:
            if not self.note_peer(request, now):
                return pc.Answer(False, pc.REFUSED + "older_instance")
            refused = 0
            for entry in request.tickets:
                proof = capability_digest(entry.keepalive) if entry.keepalive else ""
                effects = self.sidecar.apply(ev.HeartbeatReceived(now, entry.ticket, request.claimer, proof))
                refused += self.refused_by_ledger(effects, request) is not None
            return pc.Answer(refused == 0, f"{refused} refused" if refused else "")
        if kind is pc.Abandon:
            effects = self.sidecar.apply(ev.AbandonRequested(now, request.ticket,
                                                      capability_digest(request.capability)))
            refused = self.refused_by_ledger(effects, request)
            return pc.Answer(any(type(e) is fx.FreeEngineBlocks for e in effects),
                             refused.reason if refused is not None else "")
        if kind is pc.Metadata:
            return pc.MetadataAnswer(self.cfg.engine_id, self.sidecar.metadata, self.sidecar.instance)
        if kind is pc.State:
            return pc.StateAnswer(self.sidecar.summary_state() if request.summary else self.sidecar.debug_state())
        if kind is pc.Residency:
            # A count from another instance of this sidecar means nothing here: a snapshot.
            since = request.since if request.instance == self.sidecar.instance else -1
            reset, seq, events = self.sidecar.residency.answer(since)
            return pc.ResidencyAnswer(self.sidecar.instance, seq, reset, events)
        if kind is pc.Session:
            event = (ev.SessionClosed(now, request.session) if request.action == "close" else
                     ev.SessionPrefetchRequested(now, request.session, promote=request.action == "prefetch"))
            refused = _reply(self.sidecar.apply(event), fx.Rejected)
            return pc.Answer(refused is None, refused.reason if refused is not None else "")
        raise TypeError(f"no handler for {kind.__name__}")


def _reply(effects: list[fx.Effect], kind):
    for effect in effects:
        if type(effect) is kind:
            return effect
    return None
