"""The peer protocol: what other engines' sidecars and the router may ask a sidecar, as data.

A peer reaches a sidecar through xoscar, whose frames are authenticated (HMAC-SHA256 under the
deployment secret, checked before anything in a frame is unpickled: see `secret.py`). Past that
gate the sidecar's actor answers exactly one method, `call(payload: bytes) -> bytes`; `payload` is
one of the typed requests below, msgpack-encoded, and is decoded against this union with every
bound checked (id lengths and alphabet, int ranges, list sizes) before any of it reaches the
ledger. Anything else (another method, a private name, an argument that is not bytes, a wrong
type, a huge id) is refused, counted by reason and changes nothing. (xoscar unpickles an
authenticated frame before the actor sees it: holders of the secret are trusted not to send
hostile pickles; see the README's security model.)

Answers are typed too (`ClaimAnswer`, `Answer`, `MetadataAnswer`, `StateAnswer`), so the side
that asked decodes them the same way and never trusts an unpickled object.

Every call travels in an `Envelope`, inside the authenticated frame: the sender, the instance of
the engine it is for, the sender's clock and a nonce. A sidecar answers only calls addressed to
its own instance (the read-only `State` and `Residency` may be unaddressed), sent within
`FRESH_WINDOW_NS` of its clock, whose nonce it has not seen (`ReplayWindow`): a recorded call
replayed later, to another engine that shares the secret, or to a restarted one is refused and
counted (`misaddressed`, `stale`, `replayed`).
"""

from __future__ import annotations

import collections
import secrets
import time
from typing import Annotated, Union

import msgspec

from ..core.common import MAX_ID

# Ids are what kvbaton and vLLM mint (uuid hex, engine ids, "<request>/<n>" read names): short,
# printable, no spaces. 128 characters leaves room for operators' engine ids.
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID, pattern=r"^[A-Za-z0-9._:/@+=-]+$")]
# Capabilities are 32 hex characters (128 random bits).
Capability = Annotated[str, msgspec.Meta(min_length=32, max_length=64, pattern=r"^[0-9a-f]+$")]
Epoch = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
# An engine instance's epoch (128 random bits, hex) and its control address; "" when unknown.
Instance = Annotated[str, msgspec.Meta(max_length=64, pattern=r"^[0-9a-f]*$")]
Address = Annotated[str, msgspec.Meta(max_length=260, pattern=r"^[A-Za-z0-9._:\[\]-]*$")]
# One D heartbeats at most this many tickets per call to one P (its open loads from that P).
MAX_HEARTBEAT_TICKETS = 4096
# The largest request frame a sidecar decodes (a full heartbeat is about 400 KiB).
MAX_CALL_BYTES = 1 << 20
# The calls that exist: the only method name the actor answers is "call".
PEER_METHOD = "call"


class PeerCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op"):
    """Base of every peer request."""


# When an engine instance started (its wall clock, ns): of two instances of one engine at one
# address, only the one that started later replaces the other.
Started = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class Claim(PeerCall, tag="claim"):
    ticket: Id
    claimer: Id
    epoch: Epoch
    # Who claims: its instance epoch, control address and start (a newer instance at an address P
    # knows is a restarted decode engine, whose old claims P ends at once).
    instance: Instance = ""
    address: Address = ""
    started_ns: Started = 0


class ReadStart(PeerCall, tag="read_start"):
    ticket: Id
    claimer: Id
    epoch: Epoch
    read: Id


class ReadEnd(PeerCall, tag="read_end"):
    ticket: Id
    claimer: Id
    epoch: Epoch
    read: Id
    ok: bool
    release: bool = False


class Release(PeerCall, tag="release"):
    ticket: Id
    claimer: Id
    epoch: Epoch


class HeartbeatTicket(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    ticket: Id
    keepalive: Annotated[str, msgspec.Meta(max_length=64)] = ""


class Heartbeat(PeerCall, tag="heartbeat"):
    claimer: Id
    tickets: Annotated[list[HeartbeatTicket], msgspec.Meta(max_length=MAX_HEARTBEAT_TICKETS)]
    instance: Instance = ""
    address: Address = ""
    started_ns: Started = 0


class Abandon(PeerCall, tag="abandon"):
    ticket: Id
    capability: Capability


class Metadata(PeerCall, tag="metadata"):
    """The transport metadata of the answering engine (NIXL agent, registered memory)."""


class State(PeerCall, tag="state"):
    """Counters, open records and tier usage, for the router's metrics and for tests. `summary`:
    open counts, counters and transfer books only (the router's /metrics), without the state hash
    and the invariant check, whose cost grows with every history block the engine holds."""

    summary: bool = False


class Residency(PeerCall, tag="residency"):
    """What this engine's history holds, as KV events numbered after `since` (-1: a snapshot),
    for the router's cache-aware routing (see `residency.py`)."""

    since: Annotated[int, msgspec.Meta(ge=-1, le=2**62)] = -1
    instance: Instance = ""  # the sidecar instance `since` counts in ("" when none yet)


class Session(PeerCall, tag="session"):
    """The router's word on an agent session P keeps: its client's tool call is done and the next
    turn is coming ("prefetch": bring its blocks back to the GPU tier), a turn went to the decode
    engine alone ("keep": keep it its keep time from now, nothing moved), or it is over ("close").
    Only the router asks this (router_door.py); no peer engine may."""

    session: Id
    action: Annotated[str, msgspec.Meta(pattern=r"^(prefetch|keep|close)$")]


AnyPeerCall = Union[Claim, ReadStart, ReadEnd, Release, Heartbeat, Abandon, Metadata, State, Residency]


# P's block checksums on a read grant (`kv_checksums`): per worker rank, one per ticket block
# (65,536 blocks: a million-token prompt at 16 tokens a block).
MAX_RANKS = 16
MAX_SUM_BLOCKS = 1 << 16
BlockSum = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
RankSums = Annotated[tuple[BlockSum, ...], msgspec.Meta(max_length=MAX_SUM_BLOCKS)]


class Answer(msgspec.Struct, frozen=True, omit_defaults=True):
    ok: bool
    reason: str = ""
    # A granted read: how long P keeps its blocks pinned for a reader it does not hear from
    # (core.ticket: its silent-reader bound); 0: not said (D confirms the read's end).
    pinned_ns: int = 0
    # A granted read with `kv_checksums` on P: each rank's checksums of the ticket's blocks, in
    # the ticket's order (empty: not summed yet, or checksums off).
    sums: Annotated[tuple[RankSums, ...], msgspec.Meta(max_length=MAX_RANKS)] = ()


class ClaimAnswer(msgspec.Struct, frozen=True):
    """A claim's answer. On a grant, what the claimer may read, as P knows it: the engine that
    holds the blocks, its layout fingerprint, the blocks, how many prompt tokens they hold and
    the digest of those tokens."""

    granted: bool
    reason: str = ""
    engine: str = ""
    layout: str = ""
    blocks: tuple[int, ...] = ()
    num_tokens: int = 0
    digest: str = ""
    instance: str = ""  # the answering engine's instance epoch, on every answer


class MetadataAnswer(msgspec.Struct, frozen=True):
    engine: str
    metadata: bytes | None = None
    instance: str = ""


class StateAnswer(msgspec.Struct, frozen=True):
    state: dict


class ResidencyAnswer(msgspec.Struct, frozen=True):
    """`events`: a KV event batch in vLLM's shape (msgpack); `reset`: it is a snapshot, replacing
    what the asker knew; `seq`: the number of its last event; `instance`: the sidecar's epoch."""

    instance: str
    seq: int
    reset: bool
    events: bytes


# How far a call's send time may lie from the receiver's clock, either way, and so how long its
# nonce is remembered. Hosts kept by NTP agree to well under a second; a call takes milliseconds.
FRESH_WINDOW_NS = 30 * 10**9
Nonce = Annotated[str, msgspec.Meta(min_length=32, max_length=32, pattern=r"^[0-9a-f]+$")]
# What a sidecar answers to a call it refused before reading it: "refused: " and the reason.
REFUSED = "refused: "
MISADDRESSED_ANSWER = REFUSED + "misaddressed"
# The calls an unaddressed envelope may carry: they read counts and residency, and change nothing.
UNADDRESSED_CALLS = (State, Residency)


class Envelope(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """A peer call as it travels: `sender` (the caller's engine id, or "router"), `to` (the
    instance epoch of the engine it is for; "" only for UNADDRESSED_CALLS), `sent_ns` (the
    sender's wall clock), `nonce` (128 random bits) and the call."""

    sender: Id
    to: Instance
    sent_ns: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
    nonce: Nonce
    call: AnyPeerCall


def seal(call: PeerCall, to: str, sender: str, now_ns: int | None = None) -> bytes:
    """`call` in its envelope, encoded: for the engine instance `to`, from `sender`, sent now."""

    return ENCODER.encode(Envelope(sender, to, time.time_ns() if now_ns is None else now_ns,
                                   secrets.token_hex(16), call))


class ReplayWindow:
    """What a sidecar remembers to refuse calls that are not fresh: the nonces of the calls it
    accepted within the freshness window (at most `capacity`, about 40 MB at the default). A
    nonce is forgotten when it ages out, or, when more than `capacity` calls arrive within one
    window, oldest first; either way every call sent at or before a forgotten one is refused as
    stale from then on (`floor_ns`), so a forgotten nonce can never be replayed."""

    def __init__(self, window_ns: int = FRESH_WINDOW_NS, capacity: int = 1 << 18) -> None:
        self.window_ns = window_ns
        self.capacity = capacity
        self.seen: collections.OrderedDict[str, int] = collections.OrderedDict()  # nonce -> sent_ns, by arrival
        self.floor_ns = 0

    def refusal(self, envelope: Envelope, instance: str, now_ns: int) -> str | None:
        """Why `envelope` must not be answered by the engine instance `instance` at `now_ns`
        (a counter's name), or None (then its nonce is remembered)."""

        if envelope.to != instance and not (envelope.to == "" and isinstance(envelope.call, UNADDRESSED_CALLS)):
            return "misaddressed"
        if abs(now_ns - envelope.sent_ns) > self.window_ns or envelope.sent_ns <= self.floor_ns:
            return "stale"
        if envelope.nonce in self.seen:
            return "replayed"
        self.seen[envelope.nonce] = envelope.sent_ns
        self._forget(now_ns)
        return None

    def _forget(self, now_ns: int) -> None:
        seen = self.seen
        horizon = now_ns - self.window_ns
        while seen:
            nonce, sent = next(iter(seen.items()))
            if sent >= horizon and len(seen) <= self.capacity:
                break
            seen.popitem(last=False)
            # Nothing sent at or before a forgotten nonce passes again (also when this host's
            # clock steps back and an aged-out nonce would look fresh).
            self.floor_ns = max(self.floor_ns, sent)


ENCODER = msgspec.msgpack.Encoder()
CALL_DECODER = msgspec.msgpack.Decoder(Envelope)
ANSWER_DECODERS = {
    Claim: msgspec.msgpack.Decoder(ClaimAnswer),
    Metadata: msgspec.msgpack.Decoder(MetadataAnswer),
    State: msgspec.msgpack.Decoder(StateAnswer),
    Residency: msgspec.msgpack.Decoder(ResidencyAnswer),
}
_PLAIN_ANSWER = msgspec.msgpack.Decoder(Answer)


def decode_answer(call: PeerCall, raw: bytes):
    """The typed answer to `call`. A request the peer's gate refused is answered with a plain
    Answer whatever it was: a refused claim becomes a refused ClaimAnswer (not a failed call)."""

    try:
        return ANSWER_DECODERS.get(type(call), _PLAIN_ANSWER).decode(raw)
    except msgspec.ValidationError:
        plain = _PLAIN_ANSWER.decode(raw)  # raises again when it is neither
        if type(call) is Claim:
            return ClaimAnswer(False, plain.reason)
        if type(call) is Metadata:
            return MetadataAnswer("", None)
        raise


class PeerRefusal(Exception):
    """A peer request refused before it reached the ledger; `reason` is the counter's name."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def decode_call(payload: object) -> Envelope:
    """The typed request in `payload`, in its envelope, or PeerRefusal naming what was wrong."""

    if type(payload) is not bytes:
        raise PeerRefusal("malformed", f"payload is a {type(payload).__name__}, not bytes")
    if len(payload) > MAX_CALL_BYTES:
        raise PeerRefusal("oversized", f"{len(payload)} bytes (bound {MAX_CALL_BYTES})")
    try:
        return CALL_DECODER.decode(payload)
    except msgspec.ValidationError as exc:
        raise PeerRefusal("invalid", str(exc)[:200]) from None
    except msgspec.DecodeError as exc:
        raise PeerRefusal("malformed", str(exc)[:200]) from None


async def ask(ref, call: PeerCall, *, to: str, sender: str, now_ns: int | None = None):
    """Send `call` through an xoscar actor ref to the sidecar of engine instance `to` (see
    Envelope), stamped `now_ns` (the wall clock when None); its typed answer (TypeError when what
    came back is not an encoded answer)."""

    raw = await ref.call(seal(call, to, sender, now_ns))
    if type(raw) is not bytes:
        raise TypeError(f"{call.__struct_config__.tag}: the answer is a {type(raw).__name__}, not bytes")
    return decode_answer(call, raw)


def is_valid(value: object, kind) -> bool:
    """Whether `value` is what a peer message's field type (Id, Instance, ...) allows."""

    try:
        msgspec.convert(value, kind)
        return True
    except msgspec.ValidationError:
        return False


def short(ident: str) -> str:
    """An id as log lines show it: tickets are bearer capabilities while open, so never whole."""

    return ident[:8] + "…" if len(ident) > 10 else ident
