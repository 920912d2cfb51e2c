"""The sidecar's answers to peers (P side): the one door (`call`), its typed requests checked and
turned into ledger events, refusals counted and logged. A part of `Authority` (`sidecar.py`)."""

from __future__ import annotations

import logging
import time

from xoscar.core import CALL_METHOD_DEFAULT

from ..core import effects as fx
from ..core import events as ev
from ..core import ticket as tickets
from ..core.reasons import Reason
from . import peer as pc
from .guard import capability_digest, peer_address

logger = logging.getLogger("kvbaton.sidecar")

# A call from an instance that started before the one P knows at that address is refused while
# that one was heard within this long (twice the freshness window).
OLDER_INSTANCE_HEARD_NS = 2 * pc.FRESH_WINDOW_NS

# Ledger refusals that say who asked was not allowed (counted as peers.refused.<reason>).
_OWNER_REFUSALS = {Reason.NOT_CLAIMER: "not_claimer", Reason.NO_CAPABILITY: "no_capability"}


class PeerAnswers:
    """Mixed into `Authority`: how a prefill engine's sidecar answers its peers."""

    # -- calls from peers (P side) -----------------------------------------------------------------

    async def __on_receive__(self, message):
        """The only door peers have: the `call` method, one bytes argument, no keywords. Every
        other method (private ones, `__post_create__`, the shell's own) is refused."""

        try:
            method, call_method, args, kwargs = message
        except (TypeError, ValueError):
            self._refuse("method", "malformed actor message")
            raise PermissionError("not a kvbaton peer call") from None
        if method != pc.PEER_METHOD or call_method != CALL_METHOD_DEFAULT or len(args) != 1 or kwargs:
            self._refuse("method", f"method {str(method)[:64]!r}")
            raise PermissionError("kvbaton sidecars answer only their protocol's calls")
        return await super().__on_receive__(message)

    def _refuse(self, reason: str, detail: str) -> None:
        self.refused[reason] += 1
        self.refusal_log.warning(reason, "refused a peer call from %s (%s): %s", peer_address.get(),
                                 reason, detail)

    async def call(self, payload) -> bytes:
        try:
            envelope = pc.decode_call(payload)
        except pc.PeerRefusal as refusal:
            self._refuse(refusal.reason, refusal.detail)
            return pc.ENCODER.encode(pc.Answer(False, pc.REFUSED + refusal.reason))
        request = envelope.call
        stale = self.replay_window.refusal(envelope, self.instance, time.time_ns())
        if stale is not None:
            self._refuse(stale, f"{request.__struct_config__.tag} from {envelope.sender!r} for instance "
                                f"{envelope.to[:8] or '(none)'}, sent {(time.time_ns() - envelope.sent_ns) / 1e9:.1f} s ago")
            return pc.ENCODER.encode(pc.Answer(False, pc.REFUSED + stale))
        try:
            answer = self._answer(request)
        except Exception:  # a bug must not take the authority down, nor leak its text to the peer
            logger.exception("answering a peer's %s failed", request.__struct_config__.tag)
            self.refused["internal_error"] += 1
            answer = pc.ClaimAnswer(False, "internal error") if type(request) is pc.Claim else \
                pc.Answer(False, "internal error")
        return pc.ENCODER.encode(answer)

    def _reply(self, effects: list[fx.Effect], kind):
        for effect in effects:
            if type(effect) is kind:
                return effect
        return None

    def _refused_by_ledger(self, effects: list, request: pc.PeerCall) -> fx.Rejected | None:
        """A peer's request the ledger refused for who asked (not the claimer, no capability,
        claimed by another): counted and logged like the gate's refusals. Refusals of state
        (closed, unknown read) are lifecycle races, counted by the ledger only."""

        refused = self._reply(effects, fx.Rejected)
        if refused is not None:
            reason = _OWNER_REFUSALS.get(refused.reason)
            if reason is not None:
                self._refuse(reason, f"{request.__struct_config__.tag} of ticket {pc.short(refused.subject)} "
                                     f"by {getattr(request, 'claimer', '?')!r}")
        return refused

    def _note_peer(self, request: pc.Claim | pc.Heartbeat, now: int) -> bool:
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
            self._refuse("older_instance", f"{request.__struct_config__.tag} from {claimer!r} at {address} as "
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
            self._apply(ev.ReleaseRequested(now, ticket.ticket, ticket.claimer, ticket.epoch))
            ended += 1
        self.refusal_log.warning("peer_restarted", "decode engine at %s restarted (instance %s, was %s): "
                                 "ended %d of its earlier instance's claims; %d with reads in flight end "
                                 "by their read bound", address, instance[:8], known[1][:8], ended, reading)
        return True

    def _answer(self, request: pc.PeerCall):
        now = self._now()
        kind = type(request)
        if kind is pc.Claim:
            if not self._note_peer(request, now):
                return pc.ClaimAnswer(False, pc.REFUSED + "older_instance", instance=self.instance)
            reply = self._reply(self._apply(ev.ClaimRequested(now, request.ticket, request.claimer,
                                                              request.epoch)), fx.ReplyClaim)
            if reply is None:
                return pc.ClaimAnswer(False, "no reply", instance=self.instance)
            if not reply.granted:
                if reply.reason == Reason.CLAIMED_BY_ANOTHER:
                    self._refuse("not_claimer", f"claim of ticket {pc.short(request.ticket)} claimed by "
                                                f"another, by {request.claimer!r}")
                if reply.reason == Reason.UNKNOWN_TICKET:
                    self.refusal_log.warning("unknown_ticket", "claim of unknown ticket %s by %r from %s",
                                             pc.short(request.ticket), request.claimer, peer_address.get())
                return pc.ClaimAnswer(False, reply.reason, instance=self.instance)
            return pc.ClaimAnswer(True, reply.reason, self.cfg.engine_id, self.cfg.layout, reply.blocks,
                                  reply.num_tokens, reply.digest, self.instance)
        if kind is pc.ReadStart:
            effects = self._apply(ev.ReadStarted(now, request.ticket, request.claimer, request.epoch,
                                                 request.read))
            self._refused_by_ledger(effects, request)
            reply = self._reply(effects, fx.ReplyRead)
            return pc.Answer(bool(reply and reply.granted), reply.reason if reply else "no reply")
        if kind is pc.ReadEnd:
            effects = self._apply(ev.ReadFinished(now, request.ticket, request.read, request.ok,
                                                  request.claimer, request.epoch))
            refused = self._refused_by_ledger(effects, request)
            if refused is not None and refused.reason == Reason.NOT_CLAIMER:
                return pc.Answer(False, refused.reason)
            if request.release:
                self._apply(ev.ReleaseRequested(now, request.ticket, request.claimer, request.epoch))
            return pc.Answer(refused is None, refused.reason if refused is not None else "")
        if kind is pc.Release:
            refused = self._refused_by_ledger(self._apply(ev.ReleaseRequested(
                now, request.ticket, request.claimer, request.epoch)), request)
            return pc.Answer(refused is None, refused.reason if refused is not None else "")
        if kind is pc.Heartbeat:
            if not self._note_peer(request, now):
                return pc.Answer(False, pc.REFUSED + "older_instance")
            refused = 0
            for entry in request.tickets:
                proof = capability_digest(entry.keepalive) if entry.keepalive else ""
                effects = self._apply(ev.HeartbeatReceived(now, entry.ticket, request.claimer, proof))
                refused += self._refused_by_ledger(effects, request) is not None
            return pc.Answer(refused == 0, f"{refused} refused" if refused else "")
        if kind is pc.Abandon:
            effects = self._apply(ev.AbandonRequested(now, request.ticket,
                                                      capability_digest(request.capability)))
            refused = self._refused_by_ledger(effects, request)
            return pc.Answer(any(type(e) is fx.FreeEngineBlocks for e in effects),
                             refused.reason if refused is not None else "")
        if kind is pc.Metadata:
            return pc.MetadataAnswer(self.cfg.engine_id, self.metadata, self.instance)
        if kind is pc.State:
            return pc.StateAnswer(self.debug_state())
        if kind is pc.Residency:
            # A count from another instance of this sidecar means nothing here: a snapshot.
            since = request.since if request.instance == self.instance else -1
            reset, seq, events = self.residency.answer(since)
            return pc.ResidencyAnswer(self.instance, seq, reset, events)
        raise TypeError(f"no handler for {kind.__name__}")
