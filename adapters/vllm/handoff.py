"""The handoff section of `kv_transfer_params` (what P's response carries and D's request must
hold): its version, its validation (nothing from a client is trusted: the ticket, P's control
address, the token count and the layout are checked, block ids are hints), the prompt digest that
ties a grant to its prompt, and the KV layout fingerprint both ends must share."""

from __future__ import annotations

import array
import hashlib
import hmac
import ipaddress
import re
import time
from typing import Any

import msgspec

from ...control import peer as pc
from ...core.common import MAX_BLOCK_ID
from .identity import KvIdentity


PARAMS_VERSION = 1


class HandoffError(ValueError):
    """A handoff section D will not act on; `reason` names the kind, for the refusal counters
    (kvbaton_handoffs_refused{reason}): invalid, unsigned, forged, expired, untrusted_control,
    layout, tensor_parallel, weights."""

    def __init__(self, message: str, reason: str = "invalid") -> None:
        super().__init__(message)
        self.reason = reason


# What P's signature covers: everything D acts on before P's grant (whom to dial, which instance,
# which ticket, how many tokens, which layout, its keepalive) and the section's expiry. The
# router's abandon capability is not covered: the router removes it before D sees the section.
SIGNED_FIELDS = ("v", "ticket", "control", "engine", "num_tokens", "layout", "weights", "tp", "keepalive",
                 "instance", "expires")
# How far P's and D's clocks may disagree on a section's expiry.
EXPIRY_SKEW_S = 30


def handoff_key(secret: str) -> bytes:
    """The key P signs handoff sections with and D checks them with (from the deployment secret)."""

    return hashlib.blake2b(secret.encode(), key=b"kvbaton-handoff-v1", digest_size=32).digest()


def handoff_signature(section: dict, key: bytes) -> str:
    payload = msgspec.json.encode([section.get(name) for name in SIGNED_FIELDS])
    return hmac.new(key, payload, hashlib.sha256).hexdigest()[:32]


def sign_handoff(section: dict, key: bytes, ttl_s: float) -> dict:
    """`section` with an expiry (`ttl_s` from now) and P's signature over SIGNED_FIELDS."""

    signed = dict(section, expires=int(time.time() + ttl_s))
    signed["sig"] = handoff_signature(signed, key)
    return signed


# Bounds on what a request's handoff section may carry (it comes from a client, through P's
# response or not): anything past them recomputes within the step.
MAX_HANDOFF_TOKENS = 1 << 24
MAX_HINT_BLOCKS = 1 << 20


def parse_handoff(params: dict, identity: KvIdentity, trusted, key: bytes | None = None,
                  now: float | None = None) -> dict:
    """Validate the `kvbaton` section P put in kv_transfer_params; raise HandoffError naming the
    flaw. With `key` the section must carry P's signature over SIGNED_FIELDS and must not have
    expired, so D dials only addresses a P of this deployment named (a client cannot point D at
    another host, even inside `peer_networks`). Only the ticket, P's control address (which must
    be trusted: `peer_networks`), the token count and the layout are used; what to read comes
    from P's grant. `remote_block_ids` and `engine` are hints: checked for sanity, never used.
    The section's layout, tensor parallel size and weights must equal this engine's (`identity`):
    KV that other shapes or other weights computed is never read."""

    section = params.get("kvbaton")
    if not isinstance(section, dict):
        raise HandoffError("kv_transfer_params has no 'kvbaton' section (not a kvbaton handoff)")
    for name, kind in (("ticket", str), ("control", str), ("num_tokens", int), ("layout", str),
                       ("weights", str), ("tp", int)):
        if not isinstance(section.get(name), kind) or isinstance(section.get(name), bool):
            raise HandoffError(f"kvbaton handoff field {name!r} is missing or not a {kind.__name__}")
    # The same types P's sidecar checks peer messages against: what passes here passes there.
    if not pc.is_valid(section["ticket"], pc.Id):
        raise HandoffError("kvbaton handoff 'ticket' is not a ticket id")
    for name in ("keepalive", "instance"):
        if not pc.is_valid(section.get(name, ""), pc.Instance):
            raise HandoffError(f"kvbaton handoff {name!r} is not a 128-bit hex value")
    if len(section["layout"]) > 64 or len(section["weights"]) > 64:
        raise HandoffError("kvbaton handoff 'layout' or 'weights' is not a fingerprint")
    if key is not None:
        signature = section.get("sig")
        if not isinstance(signature, str) or not isinstance(section.get("expires"), int):
            raise HandoffError("kvbaton handoff is not signed (no 'sig' and 'expires': not from a P of "
                               "this deployment)", "unsigned")
        try:
            expected = handoff_signature(section, key)
        except (TypeError, ValueError, OverflowError):
            raise HandoffError("kvbaton handoff holds values that cannot be signed", "forged") from None
        if not hmac.compare_digest(signature.encode(), expected.encode()):
            raise HandoffError("kvbaton handoff signature does not match (the section was altered, or "
                               "signed with another deployment secret)", "forged")
        if section["expires"] < (time.time() if now is None else now) - EXPIRY_SKEW_S:
            raise HandoffError("kvbaton handoff has expired (P's ticket is gone by now)", "expired")
    check_control(section["control"], trusted)
    blocks = params.get("remote_block_ids")
    if blocks is not None:  # a hint: vLLM-NixlConnector-shaped proxies pass it along
        if isinstance(blocks, list) and len(blocks) == 1 and isinstance(blocks[0], list):
            blocks = blocks[0]  # per-group form
        if (not isinstance(blocks, list) or len(blocks) > MAX_HINT_BLOCKS
                or not all(type(b) is int and 0 <= b <= MAX_BLOCK_ID for b in blocks)):
            raise HandoffError("kvbaton handoff 'remote_block_ids' is not a list of block ids")
    unmapped = identity.reads_from(section["tp"])
    if unmapped:
        raise HandoffError(f"P runs tensor_parallel_size={section['tp']}, this engine "
                           f"{identity.tensor_parallel}: {unmapped}", "tensor_parallel")
    if section["layout"] != identity.layout:
        raise HandoffError(f"layout fingerprint {section['layout']!r} does not match this engine's "
                           f"{identity.layout!r} (another architecture, dtype, KV cache dtype or block "
                           f"size)", "layout")
    if section["weights"] != identity.weights:
        raise HandoffError(f"P's KV was computed by other weights (fingerprint {section['weights']!r}, "
                           f"this engine's {identity.weights!r}: another checkpoint, revision, "
                           f"quantization or KV scale setting)", "weights")
    if not 0 < section["num_tokens"] <= MAX_HANDOFF_TOKENS:
        raise HandoffError(f"kvbaton handoff covers {section['num_tokens']} tokens (1 to "
                           f"{MAX_HANDOFF_TOKENS} allowed)")
    return section


def check_control(control: str, trusted) -> None:
    """A P control address this engine may contact: `host:port` with the host in `trusted`
    (peer_networks: CIDR networks, exact names); HandoffError otherwise."""

    networks, names = trusted
    host, sep, port = control.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or len(control) > 260 or not port.isdigit() or not 0 < int(port) < 65536:
        raise HandoffError(f"kvbaton handoff 'control' {control[:80]!r} is not host:port")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if host.lower() not in names:
            raise HandoffError(f"kvbaton handoff names control host {host[:80]!r}, which is not in "
                               f"peer_networks", "untrusted_control") from None
        return
    if not any(address in net for net in networks):
        raise HandoffError(f"kvbaton handoff names control address {host!r}, which is not in "
                           f"peer_networks", "untrusted_control")


def prompt_digest(request, num_tokens: int) -> str:
    """What a handoff's blocks hold, as both sides can name it: the prompt's first `num_tokens`
    tokens and what else makes vLLM's block hashes (cache salt, LoRA, multimodal inputs). P puts
    it in the ticket; D compares it with its own request before reading anything."""

    digest = hashlib.blake2b(digest_size=16, person=b"kvbaton-prompt")
    digest.update(num_tokens.to_bytes(8, "little"))
    digest.update(array.array("q", (request.prompt_token_ids or ())[:num_tokens]).tobytes())
    salt = getattr(request, "cache_salt", None)
    if salt:
        digest.update(b"\0salt\0" + str(salt).encode())
    lora = getattr(request, "lora_request", None)
    if lora is not None:  # the adapter is part of the model that computed the KV: name and path
        digest.update(b"\0lora\0" + str(getattr(lora, "lora_name", lora)).encode())
        digest.update(b"\0" + str(getattr(lora, "lora_path", "")).encode())
    for feature in getattr(request, "mm_features", None) or ():
        ident = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None) or ""
        digest.update(b"\0mm\0" + str(ident).encode())
    return digest.hexdigest()


# --- agent sessions ------------------------------------------------------------------------------

# The id a session may have on P (the router sends a digest of the tenant's and the client's ids):
# the peer protocol's ids, so the router's Session call can name every session P keeps.
SESSION_ID_CHARS = 128
SESSION_ID = re.compile(r"[A-Za-z0-9._:/@+=-]+\Z")
SESSION_PARAM = "kvbaton_session"


def session_request(params: dict) -> tuple[str, float, bool] | str | None:
    """The agent session a request names in its kv_transfer_params (`kvbaton_session`: `id`,
    `keep_s`, `resume`): (id, keep seconds, whether an earlier turn was seen), None when it names
    none, or why the section is not one (the request is then served as any other)."""

    section = params.get(SESSION_PARAM)
    if section is None:
        return None
    if not isinstance(section, dict):
        return "the session section is not an object"
    ident, keep, resume = section.get("id"), section.get("keep_s"), section.get("resume", False)
    if not isinstance(ident, str) or not 0 < len(ident) <= SESSION_ID_CHARS or not SESSION_ID.match(ident):
        return (f"the session id must be 1 to {SESSION_ID_CHARS} of the characters A-Z a-z 0-9 . _ : / @ + = - "
                "(what the router's Session call carries)")
    if type(keep) not in (int, float) or not 0 < keep < 1e9:
        return "the session's keep_s must be a positive number of seconds"
    if type(resume) is not bool:
        return "the session's resume must be true or false"
    return ident, float(keep), resume
