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
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

# Ids are what kvbaton and vLLM mint (uuid hex, engine ids, "<request>/<n>" read names): short,
# printable, no spaces. 128 characters leaves room for operators' engine ids.
MAX_ID = 128
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID, pattern=r"^[A-Za-z0-9._:/@+=-]+$")]
# Capabilities are 32 hex characters (128 random bits).
Capability = Annotated[str, msgspec.Meta(min_length=32, max_length=64, pattern=r"^[0-9a-f]+$")]
Epoch = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
# Engine block ids a grant may name (vLLM's block pools are far smaller).
MAX_BLOCK_ID = (1 << 31) - 1
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


class Claim(PeerCall, tag="claim"):
    ticket: Id
    claimer: Id
    epoch: Epoch
    # Who claims: its instance epoch and control address (a new instance at an address P knows
    # is a restarted decode engine, whose old claims P ends at once).
    instance: Instance = ""
    address: Address = ""


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


class Abandon(PeerCall, tag="abandon"):
    ticket: Id
    capability: Capability


class Metadata(PeerCall, tag="metadata"):
    """The transport metadata of the answering engine (NIXL agent, registered memory)."""


class State(PeerCall, tag="state"):
    """Counters, open records and tier usage, for the router's metrics and for tests."""


class Residency(PeerCall, tag="residency"):
    """What this engine's history holds, as KV events numbered after `since` (-1: a snapshot),
    for the router's cache-aware routing (see `residency.py`)."""

    since: Annotated[int, msgspec.Meta(ge=-1, le=2**62)] = -1
    instance: Instance = ""  # the sidecar instance `since` counts in ("" when none yet)


AnyPeerCall = Union[Claim, ReadStart, ReadEnd, Release, Heartbeat, Abandon, Metadata, State, Residency]


class Answer(msgspec.Struct, frozen=True):
    ok: bool
    reason: str = ""


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


ENCODER = msgspec.msgpack.Encoder()
CALL_DECODER = msgspec.msgpack.Decoder(AnyPeerCall)
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


def decode_call(payload: object) -> PeerCall:
    """The typed request in `payload`, or PeerRefusal naming what was wrong."""

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


async def ask(ref, call: PeerCall):
    """Send `call` through an xoscar actor ref to a sidecar; its typed answer (TypeError when
    what came back is not an encoded answer)."""

    raw = await ref.call(ENCODER.encode(call))
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
