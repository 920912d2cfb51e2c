"""The router's door into a sidecar: four small calls over HTTP, under a key of its own.

The router faces the internet, so it holds less than an engine: not the deployment secret (which
lets a holder claim and read any engine's KV, and whose xoscar frames are unpickled once
authenticated), but a **router key** derived from it (`router_key`). With it the router can ask a
sidecar exactly four things: `Abandon` a ticket it holds the capability for, the `State`
counters, the history `Residency` it routes by, and a `Session` prefetch or close for an agent
session P keeps. Nothing on this door is pickled either way:
a request is one msgpack `RouterEnvelope` in an HTTP POST body, authenticated by an HMAC-SHA256
tag under the router key (`X-Kvbaton-Mac`) that the sidecar checks before decoding a byte, then
decoded against the four calls only, fresh and addressed like every peer call (`ReplayWindow`).
The answer is msgpack too, tagged under the same key and bound to the request's nonce, so a
sidecar (or anything between) cannot make the router decode more than a typed answer.

So a compromised router can give back tickets it was handed, read counts and move sessions'
blocks between history's tiers (or let them go), nothing more; a
compromised sidecar cannot run code in the router.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
from typing import Annotated, Union

import msgspec

from . import peer as pc

logger = logging.getLogger("kvbaton.sidecar")

PATH = "/kvbaton/v1/call"
MAC_HEADER = "X-Kvbaton-Mac"
CONTENT_TYPE = "application/msgpack"
# A router call is a few hundred bytes; anything larger is refused unread.
MAX_REQUEST_BYTES = 16 << 10
MAX_HEAD_BYTES = 8 << 10
REQUEST_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 64

RouterCall = Union[pc.Abandon, pc.State, pc.Residency, pc.Session]


class RouterEnvelope(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """A router call as it travels: `to` (the instance it is for; "" for State and Residency),
    `sent_ns` (the router's wall clock), `nonce` (128 random bits) and the call. `sender` is
    always "router" (the peer protocol's `Envelope` fields, so one replay window serves both)."""

    sender: pc.Id
    to: pc.Instance
    sent_ns: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
    nonce: pc.Nonce
    call: RouterCall


ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(RouterEnvelope)


def router_key(secret: str) -> bytes:
    """The router key of a deployment: derived from its secret one way, so engines know it and
    the router cannot get the secret back from it."""

    return hashlib.blake2b(secret.encode(), key=b"kvbaton-router-door", digest_size=32).digest()


def tag(key: bytes, *parts: bytes) -> str:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(8, "big"))
        mac.update(part)
    return mac.hexdigest()


def same_tag(expected: str, given) -> bool:
    """Whether `given` (from the network or a client) is the tag `expected`, in constant time; a
    value that is not an ASCII string is simply not it."""

    return isinstance(given, str) and given.isascii() and hmac.compare_digest(expected, given)


def seal(call, to: str, key: bytes, now_ns: int) -> tuple[bytes, str, str]:
    """(body, its tag, its nonce) of a router call to the sidecar instance `to`."""

    nonce = secrets.token_hex(16)
    body = ENCODER.encode(RouterEnvelope("router", to, now_ns, nonce, call))
    return body, tag(key, b"call", body), nonce


def open_answer(call, body: bytes, mac: str, nonce: str, key: bytes):
    """The typed answer to `call` sent with `nonce`, once its tag checks (PermissionError if not)."""

    if not same_tag(tag(key, b"answer", nonce.encode(), body), mac):
        raise PermissionError("the sidecar's answer is not tagged under the router key")
    try:
        return pc.decode_answer(call, body)
    except msgspec.ValidationError:  # a call the sidecar refused (stale, replayed, misaddressed)
        answer = msgspec.msgpack.decode(body, type=pc.Answer)
        raise PermissionError(f"the sidecar refused the router's {call.__struct_config__.tag}: {answer.reason}") from None


def answer_tag(key: bytes, nonce: str, body: bytes) -> str:
    return tag(key, b"answer", nonce.encode(), body)


# How long the router's handoff capability (below) stays good: P sees it within a request's
# queueing, far less than this, and engines' clocks agree within the peer window.
HANDOFF_CAPABILITY_S = 60


def handoff_capability(key: bytes, now_s: float) -> dict:
    """What the router adds to P's `kv_transfer_params` (`kvbaton_router`): proof that the router
    asked for this handoff, so P with `require_router_capability` hands off nothing a client of its
    own HTTP port asks for (a ticket pins P's KV until claimed or expired). It names a time, not a
    request: whoever sees one on its way to P can reuse it until it is stale, so it keeps out the
    clients that cannot see the router's traffic, which is what the engines' ports are exposed to."""

    issued = int(now_s)
    return {"t": issued, "mac": tag(key, b"handoff", str(issued).encode())[:32]}


def handoff_capability_problem(key: bytes, capability, now_s: float) -> str:
    """Why `capability` does not show the router asked ("" when it does)."""

    if not isinstance(capability, dict):
        return "no router capability"
    issued, mac = capability.get("t"), capability.get("mac")
    if type(issued) is not int or not isinstance(mac, str):
        return "malformed router capability"
    if not same_tag(tag(key, b"handoff", str(issued).encode())[:32], mac):
        return "router capability not made with the router key"
    if abs(now_s - issued) > HANDOFF_CAPABILITY_S:
        return "stale router capability"
    return ""


async def call_sidecar(client, address: str, call, key: bytes, *, to: str = "", timeout_s: float = 5.0,
                       now_ns: int | None = None):
    """Ask the sidecar whose router door is at `address` (host:port) `call`, over the httpx
    `client`; its typed answer. Raises on a refusal, a bad tag or no answer in time."""

    import time

    body, mac, nonce = seal(call, to, key, time.time_ns() if now_ns is None else now_ns)
    reply = await client.post(f"http://{address}{PATH}", content=body, timeout=timeout_s,
                              headers={MAC_HEADER: mac, "Content-Type": CONTENT_TYPE})
    if reply.status_code != 200:
        raise PermissionError(f"router call {call.__struct_config__.tag} at {address}: HTTP {reply.status_code} "
                              f"{reply.text[:200]!r}")
    return open_answer(call, reply.content, reply.headers.get(MAC_HEADER, ""), nonce, key)


async def serve(host: str, port: int, answer) -> asyncio.AbstractServer:
    """Serve the router door at host:port (port 0: the kernel chooses). `answer(body, mac)` is
    the sidecar's: it returns (HTTP status, body, answer tag)."""

    from .http_server import plain
    from .http_server import serve as serve_http

    def handler(method: str, path: str, headers: dict, body: bytes):
        if method != "POST" or path != PATH:
            return plain("404 Not Found")
        status, answer_body, mac = answer(body, headers.get(MAC_HEADER.lower(), ""))
        return status, CONTENT_TYPE, answer_body, ({MAC_HEADER: mac} if mac else {})

    return await serve_http(host, port, handler, max_connections=MAX_CONNECTIONS, timeout_s=REQUEST_TIMEOUT_S,
                            max_head_bytes=MAX_HEAD_BYTES, max_body_bytes=MAX_REQUEST_BYTES, what="a router call")
