"""Agent sessions at the router: which conversation a request belongs to, and which P keeps it.

A client names a session in the request body (`"kvbaton_session": "ID"` or `{"id": "ID",
"keep_s": SECONDS}`) or in headers (`X-Kvbaton-Session: ID`, `X-Kvbaton-Session-Keep: SECONDS`);
the body wins where both are given. The router takes the field out of the body (vLLM never sees
it) and hands P the session as a handoff parameter (`kvbaton_session`: a keyed digest of the
tenant and the client's id, so no tenant can name another's session, the keep time, and whether
an earlier turn went to that P). The session's next turn goes to the same P, which keeps the
prefix in history until the keep time runs out (adapters/vllm/handoff.py, core/session.py).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import math
from dataclasses import dataclass

SESSION_FIELD = "kvbaton_session"
SESSION_HEADER = "x-kvbaton-session"
KEEP_HEADER = "x-kvbaton-session-keep"
MAX_SESSION_CHARS = 256
# A session named without a keep time is kept this long after each turn.
DEFAULT_KEEP_S = 300.0
# The most the router remembers (least recently used first out): each is a few hundred bytes.
MAX_PLACES = 1 << 17
# In a multi-tenant router, the most open sessions one tenant may have (each P keeps at most
# `sessions_max` in all): a tenant past it is served as before, without new sessions.
DEFAULT_SESSIONS_PER_TENANT = 256


class SessionError(ValueError):
    """A session field or header the router cannot take (the client gets a 400 naming it)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SessionAsk:
    client_id: str  # what the client calls it
    key: str  # what P calls it: keyed by the router, per tenant
    keep_s: float
    tenant: str = ""


@dataclass
class Place:
    p_url: str
    until: float  # monotonic: P keeps it at most until then
    door: str = ""  # P's router door and instance, from its last answer
    instance: str = ""
    keep_s: float = DEFAULT_KEEP_S
    tenant: str = ""


def _keep(value, param: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise SessionError(f"{param} must be a number of seconds", param) from None
    if type(value) not in (int, float) or not math.isfinite(value) or not 0 < value <= 86400:
        raise SessionError(f"{param} must be a number of seconds above 0 and at most 86400", param)
    return float(value)


def session_ask(body: dict, headers, tenant: str, key: bytes) -> SessionAsk | None:
    """The session a request names (the body's field is removed), None when it names none."""

    field = body.pop(SESSION_FIELD, None)
    ident, keep = headers.get(SESSION_HEADER), headers.get(KEEP_HEADER)
    if isinstance(field, dict):
        unknown = set(field) - {"id", "keep_s"}
        if unknown:
            raise SessionError(f"{SESSION_FIELD} has unknown fields {sorted(unknown)} (id, keep_s)", SESSION_FIELD)
        ident = field.get("id")
        keep = field.get("keep_s", keep)
    elif field is not None:
        ident = field
    if ident is None:
        if keep is not None:
            raise SessionError(f"a keep time needs a session ({SESSION_FIELD} or the X-Kvbaton-Session header)",
                               SESSION_FIELD)
        return None
    if not isinstance(ident, str) or not 0 < len(ident) <= MAX_SESSION_CHARS or not ident.isprintable():
        raise SessionError(f"the session id must be 1 to {MAX_SESSION_CHARS} printable characters", SESSION_FIELD)
    keep_s = DEFAULT_KEEP_S if keep is None else _keep(keep, f"{SESSION_FIELD}.keep_s")
    return SessionAsk(ident, session_key(key, tenant, ident), keep_s, tenant)


def session_key(key: bytes, tenant: str, ident: str) -> str:
    return "s" + hmac.new(key, f"session\0{tenant}\0{ident}".encode(), hashlib.sha256).hexdigest()[:40]


class Places:
    """Which P keeps each session, least recently used first out, and how many each tenant has."""

    def __init__(self, capacity: int = MAX_PLACES) -> None:
        self.capacity = capacity
        self.places: collections.OrderedDict[str, Place] = collections.OrderedDict()
        self.by_tenant: collections.Counter[str] = collections.Counter()

    def get(self, key: str, now: float) -> Place | None:
        place = self.places.get(key)
        if place is None:
            return None
        if place.until < now:
            self.pop(key)
            return None
        self.places.move_to_end(key)
        return place

    def put(self, key: str, place: Place) -> None:
        old = self.places.pop(key, None)
        if old is not None:
            self._forget(old)
        self.places[key] = place
        self.by_tenant[place.tenant] += 1
        while len(self.places) > self.capacity:
            self._forget(self.places.popitem(last=False)[1])

    def pop(self, key: str) -> Place | None:
        place = self.places.pop(key, None)
        if place is not None:
            self._forget(place)
        return place

    def open_for(self, tenant: str, now: float) -> int:
        """The tenant's sessions, after forgetting those at the old end whose keep time ran out
        (the least recently used first: no scan of every place on a request's path)."""

        places = self.places
        while places:
            key, place = next(iter(places.items()))
            if place.until >= now:
                break
            self.pop(key)
        return self.by_tenant.get(tenant, 0)

    def _forget(self, place: Place) -> None:
        self.by_tenant[place.tenant] -= 1
        if self.by_tenant[place.tenant] <= 0:
            del self.by_tenant[place.tenant]

    def __len__(self) -> int:
        return len(self.places)
