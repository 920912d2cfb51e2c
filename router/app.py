"""The P/D router: an OpenAI-compatible front for prefill and decode vLLM engines.

For each completion or chat request: send it to a prefill engine (P) with `max_tokens=1` and
`kv_transfer_params={"do_remote_decode": true}`, take the handoff P returns, send the original
request to a decode engine (D) with it, and return (or stream) D's answer. A completion request
with a list of prompts (at most `max_batch_prompts`) is one such handoff per prompt, run side by
side, their answers merged into one (choice `index` = prompt's index × n + the choice's own): P
gets one prompt per request, so issues at most one ticket per request the router sends it. Which
P and D, and whether P is needed at all (D alone when it already holds most of the prompt), is `routing.py`'s
choice: by where the prompt's KV lives, weighed against load, or round robin. When D fails, the client goes away or the request times out after P answered, the
router abandons the ticket on P's sidecar so P's blocks come back at once (a claimed ticket belongs
to D, which releases it itself).

The router keeps no state but requests in flight and its routing index (rebuilt from the
engines' events). `/metrics` serves Prometheus metrics: the
router's own and each known P sidecar's open tickets and counters (refreshed at most every few
seconds, so scrapes cannot load the sidecars).

What it trusts: nothing from the client reaches an engine's handoff path. A client's
`kv_transfer_params` and `request_id` are dropped; D gets only what P returned, minus the abandon
capability the router keeps for itself. With an API key (`--api-key`, `KVBATON_API_KEY`) every
route but `/health` needs `Authorization: Bearer KEY`. Bodies are bounded (413), requests in
flight are bounded (429), prompts per request are bounded (400), and upstream failures are
answered without internal addresses or exception text (those go to the router's log). Every
ticket P issues for a request is either D's (D answered for its prompt) or abandoned by the
router, whatever fails or leaves first (`Held`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from . import first_token as ft
from .metrics import RoutingMetrics
from .routing import CacheRouting, Pick, RoutingCollector, RoutingConfig
from .sessions import DEFAULT_SESSIONS_PER_TENANT, Place, Places, SessionError, session_ask

logger = logging.getLogger("kvbaton.router")


def openai_error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={
        "error": {"message": message, "type": kind, "param": param, "code": code}})


class EngineSidecarCollector:
    """At scrape time, asks each P engine's sidecar for its open records and counters."""

    def __init__(self, router: "Router") -> None:
        self.router = router

    def collect(self):
        open_records = GaugeMetricFamily("kvbaton_engine_open", "Open lifecycle records in an engine's sidecar",
                                         labels=["engine", "kind"])
        counters = GaugeMetricFamily("kvbaton_engine_events", "Lifecycle counters of an engine's sidecar",
                                     labels=["engine", "name"])
        transfer = GaugeMetricFamily("kvbaton_engine_transfer", "Bytes and reads moved by an engine's transport",
                                     labels=["engine", "name"])
        for engine, state in self.router.sidecar_states().items():
            for kind, value in state.get("open", {}).items():
                open_records.add_metric([engine, kind], value)
            for name, value in state.get("counters", {}).items():
                counters.add_metric([engine, name], value)
            for name, value in state.get("transfer", {}).items():
                transfer.add_metric([engine, name], value)
        yield open_records
        yield counters
        yield transfer


# Requests larger than this are refused (413): prompts of a 128k context are ~1 MB of JSON.
DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_MAX_IN_FLIGHT = 1024
# Raw bytes of the bodies requests in flight hold, at most (a JSON body parses to ten or more
# times its size): past it a request is answered 503 until others end.
DEFAULT_MAX_BODY_MEMORY = 256 << 20
# A body must arrive whole within this long: a client trickling one holds an in-flight slot.
BODY_READ_S = 30.0
# A completion request may carry at most this many prompts (each is its own handoff).
DEFAULT_MAX_BATCH_PROMPTS = 16
# A tenant's name, as the tenant header carries it.
MAX_TENANT_CHARS = 256
# The router refreshes sidecar states for /metrics at most this often.
STATE_REFRESH_S = 5.0


def _short(ident) -> str:
    text = str(ident or "")
    return text[:8] + "…" if len(text) > 10 else text


class BadRequest(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


PROMPT_SHAPES = ("'prompt' must be a string, a list of token ids, or a non-empty list of strings or of "
                 "token-id lists (one kind, not a mix)")


def split_prompts(body: dict) -> list[dict]:
    """A completion request's prompts, one request body each, in vLLM's order (`prompt_embeds`
    first, then `prompt`), each carrying exactly one of the two fields. Empty when the body names
    no prompt (the engine answers that). BadRequest for a shape the router will not split."""

    items: list[tuple[str, object]] = []
    embeds = body.get("prompt_embeds")
    if isinstance(embeds, str):
        items.append(("prompt_embeds", embeds))
    elif isinstance(embeds, list):
        if not all(isinstance(e, str) for e in embeds):
            raise BadRequest(400, "'prompt_embeds' must be a string or a list of strings (base64)",
                             param="prompt_embeds")
        items.extend(("prompt_embeds", e) for e in embeds)
    elif embeds is not None:
        raise BadRequest(400, "'prompt_embeds' must be a string or a list of strings (base64)", param="prompt_embeds")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        items.append(("prompt", prompt))
    elif isinstance(prompt, list):
        if not prompt:
            raise BadRequest(400, "'prompt' is an empty list: " + PROMPT_SHAPES, param="prompt")
        if all(type(t) is int for t in prompt):
            items.append(("prompt", prompt))  # one prompt given as token ids
        elif all(isinstance(p, str) for p in prompt):
            items.extend(("prompt", p) for p in prompt)
        elif all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in prompt):
            items.extend(("prompt", p) for p in prompt)
        else:
            raise BadRequest(400, PROMPT_SHAPES, param="prompt")
    elif prompt is not None:
        raise BadRequest(400, PROMPT_SHAPES, param="prompt")
    bodies = []
    for field, value in items:
        one = {k: v for k, v in body.items() if k not in ("prompt", "prompt_embeds")}
        one[field] = value
        bodies.append(one)
    return bodies


HOP_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.25, 0.5, 1, 2.5)


class Held:
    """One handoff's ticket while the router answers for its prompt. It is D's once D answered
    for the prompt (D claimed it, or its claim was refused and D recomputed); before that, any
    failure or cancel makes the router abandon it, exactly once."""

    def __init__(self, router: "Router", params: dict | None = None) -> None:
        self.router = router
        self.params: dict | None = None
        self.open = False
        # When P's answer was read and D's request sent (perf_counter), for the hop's timings.
        self.answered: float | None = None
        self.posted: float | None = None
        self.keep(params)

    def keep(self, params: dict | None) -> None:
        section = (params or {}).get("kvbaton")
        self.params = params
        self.open = isinstance(section, dict) and isinstance(section.get("abandon"), str)

    def settle(self) -> None:
        """D answered for the prompt: the ticket is D's to release."""

        self.open = False

    async def abandon(self, cause: str) -> None:
        if self.open:
            self.open = False
            # On a task of its own: cancelling the caller (a sibling prompt failed, the client
            # left) must not cut the abandon short.
            await asyncio.shield(self.router.spawn(self.router.abandon(self.params, cause)))

    def abandon_soon(self, cause: str) -> None:
        """Abandon on a task of its own (from code being cancelled, which may not await)."""

        if self.open:
            self.open = False
            self.router.spawn(self.router.abandon(self.params, cause))


class Batch:
    """The handoffs of one request with several prompts, one `Held` per prompt. Once the request
    is over (`abandon_soon`), a prefill that answers later has its ticket abandoned at once."""

    def __init__(self, router: "Router", k: int) -> None:
        self.held = [Held(router) for _ in range(k)]
        self.over: str | None = None  # why the request ended early, once it did

    def keep(self, i: int, params: dict | None) -> None:
        self.held[i].keep(params)
        if self.over:
            self.held[i].abandon_soon(self.over)

    async def abandon(self, cause: str) -> None:
        await asyncio.gather(*(held.abandon(cause) for held in self.held))

    def abandon_soon(self, cause: str) -> None:
        self.over = self.over or cause
        for held in self.held:
            held.abandon_soon(cause)


class Router:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], *, timeout_s: float = 600.0,
                 models: list[str] | None = None, api_key: str | None = None, engine_api_key: str | None = None, router_key: bytes | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                 max_batch_prompts: int = DEFAULT_MAX_BATCH_PROMPTS, routing: RoutingConfig | None = None,
                 first_token: str = "prefill", tenant_header: str | None = None,
                 tenant_key: bytes | None = None, metrics_key: str | None = None,
                 max_body_memory: int = DEFAULT_MAX_BODY_MEMORY, body_read_s: float = BODY_READ_S,
                 sessions_per_tenant: int = DEFAULT_SESSIONS_PER_TENANT) -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("the router needs at least one prefill and one decode engine URL")
        if first_token not in ft.MODES:
            raise ValueError(f"first_token must be one of {', '.join(ft.MODES)}, not {first_token!r}")
        if max_batch_prompts < 1:
            raise ValueError(f"max_batch_prompts must be at least 1, not {max_batch_prompts}")
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in decode_urls]
        self.timeout_s = timeout_s
        self.api_key = api_key or None
        # Tenants (multi-tenant deployments): each request names its tenant in this header, and
        # the router salts its prompt's cache with a key only it holds, so no tenant's requests
        # can find (or time) another's cached prefixes; routing by cache is off for them.
        self.tenant_header = tenant_header.lower() if tenant_header else None
        self.tenant_key = tenant_key or secrets.token_bytes(32)
        # What names a client's session on P: derived from the router key where there is one, so
        # a restarted router (or another replica) names a returning session as before.
        self.session_key = hashlib.blake2b(router_key, key=b"kvbaton-sessions", digest_size=32).digest() \
            if router_key else self.tenant_key
        # /metrics answers this key, not the API key (operators, not API clients), when set.
        self.metrics_key = metrics_key or None
        self.max_body_bytes = max_body_bytes
        self.max_body_memory = max(max_body_memory, max_body_bytes)
        self.body_read_s = body_read_s
        self.body_bytes = 0  # raw bytes of the bodies requests in flight hold
        self.max_in_flight = max_in_flight
        self.max_batch_prompts = max_batch_prompts
        self.first_token = first_token
        self.context_limits: dict[str, int] = {}  # model -> max_model_len (see refresh_context_limits)
        self._context_limits_at = float("-inf")
        self.active = 0
        self._background: set[asyncio.Task] = set()  # abandons and handoffs run on tasks of their own
        self._states_at = float("-inf")
        self.models = set(models or [])
        self.controls: dict[str, str] = {}  # P engine id -> its sidecar's router door (learned from handoffs)
        # The router key (router_door.py): all the router holds to call sidecars, never the
        # deployment secret, and nothing it receives from them is unpickled.
        self.router_key = router_key or b""
        # The sidecars' doors get a client of their own: never queued behind the engines' streams,
        # never sent the engines' API key.
        self.door_client = httpx.AsyncClient(timeout=httpx.Timeout(10.0), limits=httpx.Limits(max_connections=32))
        # The engines' API key (kvbaton serve gives each deployment's engines one): every call to an
        # engine carries it, so only the router reaches their /v1 routes.
        # Every request in flight may hold a connection to P and one to D: the pool never makes
        # one wait for another's (httpx's default is 100, with 20 kept open between requests, so
        # a few dozen streams already reopened connections to D for every request).
        connections = 2 * self.max_in_flight + 64
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), headers=(
            {"Authorization": f"Bearer {engine_api_key}"} if engine_api_key else None),
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))
        self.registry = CollectorRegistry()
        self.requests = Counter("kvbaton_router_requests", "Requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=self.registry)
        self.abandons = Counter("kvbaton_router_abandons", "Tickets the router abandoned, by cause",
                                ["cause"], registry=self.registry)
        self.in_flight = Gauge("kvbaton_router_in_flight", "Requests in flight", registry=self.registry)
        self.batches = Counter("kvbaton_router_batch_requests", "Completion requests with several prompts",
                               registry=self.registry)
        self.batch_prompts = Counter("kvbaton_router_batch_prompts",
                                     "Prompts of completion requests with several prompts (one handoff each)",
                                     registry=self.registry)
        self.first_tokens = Counter("kvbaton_router_first_token",
                                    "Handed-off requests by where their first token came from (prefill: P's, "
                                    "sent at once; decode: D computed it) and why not from P",
                                    ["source", "reason"], registry=self.registry)
        self.ttft = Histogram("kvbaton_router_ttft_seconds",
                              "Time to the first token the router has for the client (P's, or D's first byte)",
                              registry=self.registry,
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.prefill_time = Histogram("kvbaton_router_prefill_seconds", "Time P took to answer",
                                      registry=self.registry,
                                      buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        # The hop between P's answer and D's: where a handed-off request's time goes after P
        # answered (with the first token from P, the client waits through it for its second).
        self.handoff_hop = Histogram("kvbaton_router_handoff_hop_seconds",
                                     "A handed-off request after P answered: P's answer read -> D's request sent "
                                     "(answer_to_post), D's request sent -> D's first bytes (post_to_first_byte)",
                                     ["phase"], registry=self.registry, buckets=HOP_BUCKETS)
        # The router's own loop: a late wake-up delays every request it carries.
        self.loop_lag = Histogram("kvbaton_router_loop_lag_seconds",
                                  "How late the router's event loop ran a timer it set (sampled every 50 ms)",
                                  registry=self.registry, buckets=HOP_BUCKETS)
        self.sessions = Counter("kvbaton_router_sessions",
                                "Agent session turns and calls: placed on the P that keeps the session (kept), "
                                "a first turn (new), served by D alone (decode), a keeping P gone (moved), a tenant "
                                "with as many sessions as it may (tenant_limit: served without one), "
                                "the client's prefetch or close (prefetch, close, with _unknown or _failed), P told to keep a session "
                                "whose turns D alone serves (keep, with _unknown or _failed)",
                                ["outcome"], registry=self.registry)
        self.session_places = Places()
        # With tenants: the most sessions one tenant may have open (P's session bounds are per P).
        self.sessions_per_tenant = sessions_per_tenant
        self.registry.register(EngineSidecarCollector(self))
        self.routing = RoutingMetrics(self.registry)
        # Which engines serve a request (cache-aware, or round robin with routing="round-robin").
        self.placement = CacheRouting(routing or RoutingConfig(mode="round-robin"), self.prefill_urls,
                                      self.decode_urls)
        self.registry.register(RoutingCollector(self.placement))
        if self.router_key:
            self.placement.call_sidecar = self.call_sidecar
        self._states: dict[str, dict] = {}

    # -- helpers ---------------------------------------------------------------------------------

    def refresh_context_limits(self) -> None:
        """Read each served model's max_model_len from D's /v1/models (vLLM's server states it)
        on a task of its own: once, retried at most every minute while unknown. No request waits
        for it; until it is known, only a prompt that P's token fills to the limit is affected."""

        if self.context_limits or time.monotonic() < self._context_limits_at + 60.0:
            return
        self._context_limits_at = time.monotonic()
        self.spawn(self._read_context_limits())

    async def _read_context_limits(self) -> None:
        try:
            reply = await asyncio.wait_for(self.client.get(f"{self.decode_urls[0]}/v1/models", timeout=5.0), 5.0)
            for entry in reply.json().get("data", []):
                if isinstance(entry, dict) and type(entry.get("max_model_len")) is int:
                    self.context_limits[entry.get("id")] = entry["max_model_len"]
        except Exception as exc:  # noqa: BLE001 - a figure the router can do without
            logger.info("could not read max_model_len from %s: %r", self.decode_urls[0], exc)

    async def refresh_models(self) -> None:
        self.refresh_context_limits()
        if self.models:
            return
        for url in self.decode_urls + self.prefill_urls:
            try:
                reply = await self.client.get(f"{url}/v1/models", timeout=5.0)
                self.models.update(m["id"] for m in reply.json().get("data", []))
            except Exception as exc:
                logger.warning("could not list models on %s: %s", url, exc)

    def sidecar_states(self) -> dict[str, dict]:
        return dict(self._states)

    async def call_sidecar(self, address: str, call, *, to: str = "", timeout_s: float = 5.0):
        """`call` (Abandon, State or Residency) at the sidecar whose router door is `address`."""

        from ..control.router_door import call_sidecar

        if not self.router_key:
            raise ConnectionError("the router holds no router key (kvbaton serve derives it from the secret)")
        return await call_sidecar(self.door_client, address, call, self.router_key, to=to, timeout_s=timeout_s)

    async def refresh_sidecar_states(self) -> None:
        from ..control import peer as pc

        if time.monotonic() - self._states_at < STATE_REFRESH_S and set(self.controls) <= set(self._states):
            return
        self._states_at = time.monotonic()
        for engine, address in list(self.controls.items()):
            try:
                answer = await self.call_sidecar(address, pc.State(summary=True), timeout_s=2.0)
                self._states[engine] = answer.state
            except Exception as exc:
                logger.warning("could not read the state of sidecar %s: %r", address, exc)
                self._states[engine] = {"error": "unreachable"}

    async def abandon(self, params: dict | None, cause: str) -> None:
        """Give P's blocks back now (the ticket is unclaimed): with the capability P gave only
        to the router (`abandon` in P's answer, never forwarded), through P's router door."""

        section = (params or {}).get("kvbaton")
        if not isinstance(section, dict) or not isinstance(section.get("abandon"), str):
            return
        from ..control import peer as pc

        try:
            if not isinstance(section.get("router"), str) or not section["router"]:
                raise ConnectionError("P's answer names no router door")
            answer = await self.call_sidecar(section["router"], pc.Abandon(section["ticket"], section["abandon"]),
                                             to=str(section.get("instance") or ""), timeout_s=5.0)
            refused = answer.reason.startswith(pc.REFUSED)  # not fresh or misaddressed: counted there too
            self.abandons.labels(cause if answer.ok else cause + ("_refused" if refused else "_already_claimed")).inc()
        except Exception as exc:
            self.abandons.labels(cause + "_unreachable").inc()
            logger.warning("could not abandon ticket %s on %s: %r", _short(section.get("ticket")),
                           section.get("router"), exc)

    def spawn(self, coro) -> asyncio.Task:
        """Run `coro` on a task of its own, kept until it is done."""

        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def authorized(self, request: Request) -> bool:
        if self.api_key is None:
            return True
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # Constant time over the key's bytes whatever the client sent.
        return hmac.compare_digest(token.strip().encode(), self.api_key.encode()) and scheme.lower() == "bearer"

    async def read_body(self, request: Request) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise BadRequest(400, "the Content-Length header is not a number")
            if int(declared) > self.max_body_bytes:
                raise BadRequest(413, f"the request body is larger than {self.max_body_bytes} bytes")
        chunks, size = [], 0

        async def read() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise BadRequest(413, f"the request body is larger than {self.max_body_bytes} bytes")
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), self.body_read_s)
        except asyncio.TimeoutError:
            raise BadRequest(408, f"the request body did not arrive within {self.body_read_s:.0f} s") from None
        if self.body_bytes + size > self.max_body_memory:
            raise BadRequest(503, "the router holds as many request bodies as it may; retry shortly")
        self.body_bytes += size
        request.state.body_bytes = size  # given back when the request ends (_release)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, RecursionError):  # bad JSON, bad UTF-8, absurd nesting
            raise BadRequest(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise BadRequest(400, "the request body must be a JSON object")
        if not isinstance(body.get("model", ""), (str, type(None))):
            raise BadRequest(400, "'model' must be a string")
        return body

    # -- the request path ------------------------------------------------------------------------

    def tenant_salt(self, tenant: str, client_salt=None) -> str:
        """The cache salt of a tenant's request: keyed by the router, folding in the client's own
        salt (a tenant may still separate its users)."""

        extra = client_salt if isinstance(client_salt, str) else ""
        return hmac.new(self.tenant_key, f"{tenant}\0{extra}".encode(), hashlib.sha256).hexdigest()[:32]

    def metrics_authorized(self, request: Request) -> bool:
        if self.metrics_key is None:
            return self.authorized(request)
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.metrics_key.encode())

    async def handle(self, request: Request, endpoint: str) -> Response:
        if self.active >= self.max_in_flight:
            self.requests.labels(endpoint, "too_many_in_flight").inc()
            return openai_error(429, "too many requests in flight; retry later", kind="rate_limit_error")
        self.active += 1
        self.in_flight.inc()
        streaming = False
        try:
            response = await self._handle(request, endpoint)
            if isinstance(response, HeldStream):
                # A stream holds its place (and its body) until it is over, however it ends (a
                # client that leaves before its first byte included).
                response.on_close = lambda: self._release(request)
                streaming = True
            return response
        finally:
            if not streaming:
                self._release(request)

    def _release(self, request: Request) -> None:
        self.active -= 1
        self.in_flight.dec()
        self.body_bytes -= getattr(request.state, "body_bytes", 0)


    async def _handle(self, request: Request, endpoint: str) -> Response:
        try:
            body = await self.read_body(request)
        except BadRequest as exc:
            self.requests.labels(endpoint, {413: "too_large", 408: "slow_body", 503: "body_memory"}.get(
                exc.status, "bad_request")).inc()
            return openai_error(exc.status, exc.message)
        if self.tenant_header is not None:
            tenant = request.headers.get(self.tenant_header, "")
            if not tenant or len(tenant) > MAX_TENANT_CHARS:
                self.requests.labels(endpoint, "no_tenant").inc()
                return openai_error(400, f"this router serves several tenants: the {self.tenant_header} header must "
                                         f"name the request's tenant (1 to {MAX_TENANT_CHARS} characters)")
            body["cache_salt"] = self.tenant_salt(tenant, body.get("cache_salt"))
        tenant = request.headers.get(self.tenant_header, "") if self.tenant_header is not None else ""
        try:
            session = session_ask(body, request.headers, tenant, self.session_key)
        except SessionError as exc:
            self.requests.labels(endpoint, "bad_request").inc()
            return openai_error(400, str(exc), param=exc.param)
        # Handoff parameters and request ids are the router's to set, never the client's (vLLM
        # also reads kv_transfer_params from vllm_xargs).
        body.pop("kv_transfer_params", None)
        body.pop("request_id", None)
        if isinstance(body.get("vllm_xargs"), dict):
            body["vllm_xargs"] = {k: v for k, v in body["vllm_xargs"].items() if k != "kv_transfer_params"}
        elif "vllm_xargs" in body:
            body.pop("vllm_xargs")
        await self.refresh_models()
        model = body.get("model")
        if self.models and model not in self.models:
            self.requests.labels(endpoint, "unknown_model").inc()
            return openai_error(404, f"The model `{model}` does not exist (served: {sorted(self.models)}).",
                                param="model", code="model_not_found")
        n = body.get("n", 1)
        if n is None:
            n = 1
        if type(n) is not int or n < 1:
            self.requests.labels(endpoint, "bad_request").inc()
            return openai_error(400, "'n' must be a positive integer", param="n")
        if endpoint == "/v1/completions":
            # vLLM makes one engine request, so P one ticket, per prompt of a list, and answers
            # with the first one's handoff only: P gets one prompt per request, always.
            try:
                prompts = split_prompts(body)
            except BadRequest as exc:
                self.requests.labels(endpoint, "bad_request").inc()
                return openai_error(exc.status, exc.message, param=exc.param)
            if len(prompts) > self.max_batch_prompts:
                self.requests.labels(endpoint, "too_many_prompts").inc()
                return openai_error(400, f"a request may carry at most {self.max_batch_prompts} prompts (the "
                                         f"router's --max-batch-prompts); this one carries {len(prompts)}",
                                    param="prompt", code="too_many_prompts")
            if len(prompts) > 1:
                if session is not None:
                    self.requests.labels(endpoint, "bad_request").inc()
                    return openai_error(400, "a session is one conversation: send one prompt per request",
                                        param="kvbaton_session")
                return await self._batch(request, endpoint, prompts, n)
            if prompts:
                body = prompts[0]
        pick = await self.placement.pick(endpoint, body)
        if session is not None:
            self.place_session(pick, session)
        self.routing.routed(None if pick.p_url is None else pick.how, disaggregated=pick.p_url is not None)
        if n > 1:
            self.routing.parallel(n)
        return await self._route(request, endpoint, body, pick.p_url, pick.d_url, pick)

    def place_session(self, pick: Pick, session) -> None:
        """A session's turn goes to the P that keeps it (a turn D alone serves stays there: D holds
        the prefix); a first turn, or one whose P is gone, goes where routing chose."""

        now = time.monotonic()
        place = self.session_places.get(session.key, now)
        if (place is None and self.tenant_header is not None
                and self.session_places.open_for(session.tenant, now) >= self.sessions_per_tenant):
            # Served as any other request: this tenant has as many sessions open as it may.
            self.sessions.labels("tenant_limit").inc()
            return
        pick.session = session
        if pick.p_url is None:
            self.sessions.labels("decode").inc()
            if place is not None and place.door and place.until - now < place.keep_s / 2:
                # The conversation goes on, on D alone: P keeps the session its keep time from
                # now, so a turn that needs P later still finds it (once per half keep time).
                place.until = now + place.keep_s
                self.spawn(self._keep_session(session, place))
            return
        if place is None:
            self.sessions.labels("new").inc()
        elif place.p_url in self.prefill_urls:
            pick.p_url, pick.how, pick.resume = place.p_url, "session", True
            self.sessions.labels("kept").inc()
        else:
            self.sessions.labels("moved").inc()

    async def _keep_session(self, session, place) -> None:
        from ..control import peer as pc

        try:
            answer = await self.call_sidecar(place.door, pc.Session(session.key, "keep"), to=place.instance,
                                             timeout_s=5.0)
        except Exception as exc:  # the next turn that needs P tries again (or recomputes)
            logger.debug("could not keep session on %s: %r", place.door, exc)
            place.until = time.monotonic()
            self.sessions.labels("keep_failed").inc()
            return
        if not answer.ok:  # P let it go meanwhile: the next turn starts it again
            self.session_places.pop(session.key)
            self.sessions.labels("keep_unknown").inc()
            return
        self.sessions.labels("keep").inc()

    def session_kept(self, pick: Pick, p_url: str, section) -> None:
        """P answered a session's turn: remember that it keeps the session, and where to reach it."""

        door = section.get("router") if isinstance(section, dict) else None
        instance = section.get("instance") if isinstance(section, dict) else None
        self.session_places.put(pick.session.key, Place(p_url, time.monotonic() + pick.session.keep_s,
                                                        door if isinstance(door, str) else "",
                                                        instance if isinstance(instance, str) else "",
                                                        pick.session.keep_s, pick.session.tenant))

    async def session_call(self, request: Request, ident: str, action: str) -> Response:
        """The client's word on a session: its tool call is done and the next turn is coming
        (`prefetch`: P brings the session's blocks back to its GPU tier now), or it is over
        (`close`: P keeps them no longer)."""

        from ..control import peer as pc

        tenant = request.headers.get(self.tenant_header, "") if self.tenant_header is not None else ""
        if self.tenant_header is not None and not tenant:
            return openai_error(400, f"the {self.tenant_header} header must name the session's tenant")
        try:
            session = session_ask({"kvbaton_session": ident}, {}, tenant, self.session_key)
        except SessionError as exc:
            return openai_error(400, str(exc), param="session")
        if not self.router_key:
            self.sessions.labels(action + "_failed").inc()
            return openai_error(503, "this router holds no router key, so it cannot reach the engines' sidecars "
                                     "(kvbaton serve derives one from the secret)", kind="upstream_error")
        place = self.session_places.get(session.key, time.monotonic())
        if place is None or not place.door:
            self.sessions.labels(action + "_unknown").inc()
            return openai_error(404, "no engine keeps this session (never seen, expired or closed)",
                                param="session", code="session_not_found")
        try:
            answer = await self.call_sidecar(place.door, pc.Session(session.key, action), to=place.instance,
                                             timeout_s=5.0)
        except Exception as exc:  # the place stays: the client may try again
            logger.warning("could not %s session on %s: %r", action, place.door, exc)
            self.sessions.labels(action + "_failed").inc()
            return openai_error(502, "the engine that keeps this session did not answer", kind="upstream_error")
        if not answer.ok or action == "close":
            self.session_places.pop(session.key)
        if not answer.ok:
            self.sessions.labels(action + "_unknown").inc()
            return openai_error(404, f"the engine no longer keeps this session ({answer.reason})",
                                param="session", code="session_not_found")
        self.sessions.labels(action).inc()
        if action == "prefetch":
            place.until = time.monotonic() + place.keep_s
        return JSONResponse({"session": ident, "action": action, "ok": True})

    async def _route(self, request: Request, endpoint: str, body: dict, p_url: str | None, d_url: str,
                     pick: Pick | None = None) -> Response:
        started = time.perf_counter()
        params = None
        first: ft.FirstToken | None = None
        if p_url is not None:
            prefilled = await self._prefill(endpoint, body, p_url, started, pick)
            if isinstance(prefilled[0], str):
                self.requests.labels(endpoint, prefilled[0]).inc()
                return prefilled[1]
            params, answer = prefilled
            first = self._first_token(endpoint, body, answer)
        # (p_url None: D alone, it holds most of the prompt; no handoff, nothing to abandon.)
        held = Held(self, params)
        if p_url is not None:
            held.answered = time.perf_counter()
        if first is not None:
            return await self._continue(request, endpoint, body, d_url, params, held, first, started)
        d_body = with_handoff(body, params)
        if await request.is_disconnected():
            await held.abandon("client_gone")
            self.requests.labels(endpoint, "client_gone").inc()
            return Response(status_code=499)
        if body.get("stream"):
            return HeldStream(self._stream(endpoint, d_url, d_body, held, started), held=held,
                              media_type="text/event-stream")
        d_reply = await self._decode(endpoint, d_url, d_body, held, started)
        if isinstance(d_reply, tuple):
            self.requests.labels(endpoint, d_reply[0]).inc()
            return d_reply[1]
        if p_url is None and pick is not None:
            with contextlib.suppress(ValueError):
                self.placement.check_tokens(pick, d_reply.json())
        self.requests.labels(endpoint, "ok").inc()
        return Response(d_reply.content, status_code=d_reply.status_code, media_type="application/json")

    def _first_token(self, endpoint: str, body: dict, answer) -> ft.FirstToken | None:
        """P's first token for the client (`first_token="prefill"`), or None: D computes it
        (the decode path), counted with the reason."""

        if self.first_token != "prefill":
            self.first_tokens.labels("decode", "configured").inc()
            return None
        why = ft.refusal(endpoint, body)
        first = ft.read_first_token(endpoint, body, answer, self.context_limits.get(body.get("model"))) \
            if why is None else why
        if isinstance(first, str):
            self.first_tokens.labels("decode", first).inc()
            return None
        self.first_tokens.labels("prefill", "ended" if first.ends else "continued").inc()
        return first

    async def _continue(self, request: Request, endpoint: str, body: dict, d_url: str, params: dict | None,
                        held: Held, first: ft.FirstToken, started: float) -> Response:
        """The client gets P's token at once; D continues from the prompt plus that token (a
        completion, whatever the client's endpoint) and its answer is joined to P's."""

        self.ttft.observe(time.perf_counter() - started)
        if first.ends:
            # P's token ended the request: D is never called, P's blocks come back at once (on a
            # task of its own: the client's answer does not wait for P's sidecar).
            held.abandon_soon("ended_on_prefill")
            self.requests.labels(endpoint, "ok").inc()
            if body.get("stream"):
                stream = ft.ContinuedStream(first, body)
                return StreamingResponse(iter(stream.opening()), media_type="text/event-stream")
            return JSONResponse(ft.answer_from_prefill(first))
        d_body = with_handoff(ft.continuation_body(body, first), params)
        if body.get("stream"):
            return HeldStream(self._stream_continued(endpoint, d_url, d_body, held, started, first, body),
                              held=held, media_type="text/event-stream")
        if await request.is_disconnected():
            await held.abandon("client_gone")
            self.requests.labels(endpoint, "client_gone").inc()
            return Response(status_code=499)
        d_reply = await self._decode(ft.CONTINUE_ENDPOINT, d_url, d_body, held, started, observe=False)
        if isinstance(d_reply, tuple):
            self.requests.labels(endpoint, d_reply[0]).inc()
            return d_reply[1]
        try:
            joined = ft.joined_answer(first, d_reply.json())
        except ValueError:
            joined = None
        if joined is None:
            logger.warning("decode engine %s answered a continuation without a completion: %.300r", d_url,
                           d_reply.content)
            self.requests.labels(endpoint, "decode_malformed").inc()
            return openai_error(502, "the decode engine could not serve the request", kind="upstream_error")
        self.requests.labels(endpoint, "ok").inc()
        return JSONResponse(joined)

    async def _stream_continued(self, endpoint: str, d_url: str, d_body: dict, held: Held, started: float,
                                first: ft.FirstToken, body: dict) -> AsyncIterator[bytes]:
        """P's token, then D's continuation as it comes, as one engine's stream."""

        stream = ft.ContinuedStream(first, body)
        for chunk in stream.opening():
            yield chunk
        d_usage = None
        failed = False
        buffer = b""
        chunks = self._stream(ft.CONTINUE_ENDPOINT, d_url, d_body, held, started, observe=False,
                              record=lambda outcome: self.requests.labels(endpoint, outcome).inc())
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                buffer = buffer + chunk
                if b"\r" in buffer:
                    buffer = buffer.replace(b"\r\n", b"\n")
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    if event == b"data: [DONE]":
                        continue  # (the closing one is ours)
                    rewritten, payload = stream.rewrite_event(event)
                    if payload is not None and "error" in payload:
                        failed = True
                        yield b"data: " + compact(payload) + b"\n\n"
                        continue
                    if payload is not None and isinstance(payload.get("usage"), dict):
                        d_usage = payload["usage"]
                    if rewritten is not None:
                        yield rewritten
        if not failed:
            for chunk in stream.closing(d_usage):
                yield chunk

    async def _prefill(self, endpoint: str, body: dict, p_url: str, started: float,
                       pick: Pick | None, first_token: bool = True) -> tuple[dict | None, dict | None] | tuple[str, Response]:
        """P computes the prompt and its first token (max_tokens=1) and answers with the handoff:
        (its kv_transfer_params or None when it gave none, its answer), or (outcome, the error
        Response for the client)."""

        # n > 1 is one prefill and one handoff: P computes the prompt once (n=1 there, so one
        # ticket), D samples n times from it (its children share the one handoff, see
        # PROTOCOL.md).
        # (P's token ids only when its first token may be the client's: they are the whole prompt.)
        p_body = ft.prefill_body(body, token_ids=first_token and self.first_token == "prefill"
                                 and ft.refusal(endpoint, body) is None)
        if pick is not None and pick.session is not None:
            p_body["kv_transfer_params"]["kvbaton_session"] = {
                "id": pick.session.key, "keep_s": pick.session.keep_s, "resume": pick.resume}
        if self.router_key:  # P hands off only what the router asked for (require_router_capability)
            from ..control.router_door import handoff_capability

            p_body["kv_transfer_params"]["kvbaton_router"] = handoff_capability(self.router_key, time.time())
        p_body["request_id"] = f"kvb-{uuid.uuid4().hex}"
        try:
            with self.placement.busy(p_url):
                p_reply = await self.client.post(f"{p_url}{endpoint}", json=p_body)
        except httpx.HTTPError as exc:
            logger.warning("prefill engine %s failed: %r", p_url, exc)
            return "prefill_unreachable", openai_error(502, "the prefill engine is unreachable", kind="upstream_error")
        if p_reply.status_code != 200:
            return (f"prefill_{p_reply.status_code}",
                    upstream_error(p_reply.status_code, p_reply.content, "prefill", p_url))
        self.prefill_time.observe(time.perf_counter() - started)
        try:
            reply_json = p_reply.json()
            params = reply_json.get("kv_transfer_params")
        except (ValueError, AttributeError):
            reply_json, params = None, None
        if pick is not None:
            self.placement.check_tokens(pick, reply_json)
        if not isinstance(params, dict):
            params = None
        section = (params or {}).get("kvbaton")
        if pick is not None and pick.session is not None:
            self.session_kept(pick, p_url, section)
        if isinstance(section, dict) and section.get("engine") and isinstance(section.get("router"), str) \
                and section["router"]:
            self.controls[str(section["engine"])] = section["router"]
            self.placement.watch_history(p_url, section["router"])
        return params, reply_json if isinstance(reply_json, dict) else None

    def _hop(self, held: Held, phase: str) -> None:
        """Time the hop after P's answer (`phase`: answer_to_post, then post_to_first_byte)."""

        since = held.answered if phase == "answer_to_post" else held.posted
        if since is not None:
            now = time.perf_counter()
            self.handoff_hop.labels(phase).observe(now - since)
            # Each once per handoff: a retry on the next D is not a second hop.
            held.answered, held.posted = None, (now if phase == "answer_to_post" else None)

    async def _decode(self, endpoint: str, d_url: str, d_body: dict, held: Held,
                      started: float, observe: bool = True) -> httpx.Response | tuple[str, Response]:
        """D's answer (status 200; the handoff is then D's), or (outcome, the error Response for
        the client) with the handoff abandoned."""

        d_reply = None
        for attempt, url in enumerate(self._decode_order(d_url)):
            try:
                with self.placement.busy(url):
                    self._hop(held, "answer_to_post")
                    d_reply = await self.client.post(f"{url}{endpoint}", json=d_body)
                    self._hop(held, "post_to_first_byte")
                break
            except httpx.TransportError as exc:
                # D is down. The handoff is still good for another D: unclaimed, it is claimed
                # there; claimed by the dead D, the claim is refused and that D recomputes.
                logger.warning("decode engine %s failed (%r); trying the next one", url, exc)
                if attempt == len(self.decode_urls) - 1:
                    await held.abandon("decode_failed")
                    return "decode_unreachable", openai_error(502, "the decode engines are unreachable",
                                                              kind="upstream_error")
        if observe:
            self.ttft.observe(time.perf_counter() - started)
        if d_reply.status_code != 200:
            await held.abandon("decode_failed")
            return f"decode_{d_reply.status_code}", upstream_error(d_reply.status_code, d_reply.content, "decode", url)
        held.settle()
        return d_reply

    def _decode_order(self, first: str) -> list[str]:
        index = self.decode_urls.index(first)
        return self.decode_urls[index:] + self.decode_urls[:index]

    async def _stream(self, endpoint: str, d_url: str, d_body: dict, held: Held, started: float,
                      record=None, observe: bool = True) -> AsyncIterator[bytes]:
        """D's streamed answer, as it comes. `record` takes the outcome (default: counted)."""

        sent = False
        outcome = "ok"
        order = self._decode_order(d_url)
        try:
            for attempt, url in enumerate(order):
                try:
                    with self.placement.busy(url):
                        self._hop(held, "answer_to_post")
                        async with self.client.stream("POST", f"{url}{endpoint}", json=d_body) as reply:
                            if reply.status_code != 200:
                                outcome = f"decode_{reply.status_code}"
                                await held.abandon("decode_failed")
                                payload = await reply.aread()
                                error = upstream_error(reply.status_code, payload, "decode", url)
                                yield b"data: " + error.body + b"\n\n"
                                return
                            async for chunk in reply.aiter_bytes():
                                if not sent:
                                    self._hop(held, "post_to_first_byte")
                                    if observe:
                                        self.ttft.observe(time.perf_counter() - started)
                                    sent = True
                                    held.settle()
                                yield chunk
                    return
                except httpx.TransportError as exc:
                    if not sent and attempt < len(order) - 1:
                        logger.warning("decode engine %s failed (%r); trying the next one", url, exc)
                        continue
                    outcome = "decode_unreachable"
                    await held.abandon("decode_failed")
                    logger.warning("decode engine %s failed mid-stream: %r", url, exc)
                    error = {"error": {"message": "the decode engine failed", "type": "upstream_error"}}
                    yield f"data: {json.dumps(error)}\n\n".encode()
                    return
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away mid-stream. Nothing may be awaited here (the task is being
            # cancelled), so the abandon runs on its own. Once D sent a token it had claimed the
            # ticket (or recomputed), which is then D's to release: no call (`held` is settled).
            # (A client that closes right after `[DONE]` lands here too, and cost a sidecar call
            # per request.)
            outcome = "client_gone"
            held.abandon_soon("client_gone")
            raise
        finally:
            if record is None:
                self.requests.labels(endpoint, outcome).inc()
            else:
                record(outcome)

    # -- several prompts in one completion request -------------------------------------------------

    async def _batch(self, request: Request, endpoint: str, bodies: list[dict], n: int) -> Response:
        """One handoff per prompt (each picked, prefilled and decoded as if sent alone), side by
        side; one answer, choices indexed as vLLM and OpenAI do (prompt's index × n + choice's)."""

        k = len(bodies)
        self.batches.inc()
        self.batch_prompts.inc(k)
        picks = []
        for one in bodies:
            pick = await self.placement.pick(endpoint, one)
            self.routing.routed(None if pick.p_url is None else pick.how, disaggregated=pick.p_url is not None)
            if n > 1:
                self.routing.parallel(n)
            picks.append(pick)
        started = time.perf_counter()
        batch = Batch(self, k)

        async def prefill(i: int):
            if picks[i].p_url is None:
                return None  # D alone
            result = await self._prefill(endpoint, bodies[i], picks[i].p_url, started, picks[i], first_token=False)
            if isinstance(result[0], str):
                return result  # (outcome, error response)
            batch.keep(i, result[0])
            return result[0]

        # Every prefill runs to its end, even when the client leaves: one cut short could leave a
        # ticket the router never hears of. A prefill answering after the request ended has its
        # ticket abandoned at once (`Batch.keep`).
        results = await self._all(batch, [self.spawn(prefill(i)) for i in range(k)], cancel=False)
        failed = await self._batch_failure(endpoint, batch, results)
        if failed is not None:
            return failed
        try:
            gone = await request.is_disconnected()
        except BaseException:
            batch.abandon_soon("client_gone")
            raise
        if gone:
            await batch.abandon("client_gone")
            self.requests.labels(endpoint, "client_gone").inc()
            return Response(status_code=499)
        d_bodies = [with_handoff(one, held.params) for one, held in zip(bodies, batch.held)]
        if bodies[0].get("stream"):
            return HeldStream(self._stream_batch(endpoint, picks, d_bodies, batch, n, started), held=batch,
                              media_type="text/event-stream")

        async def decode(i: int):
            reply = await self._decode(endpoint, picks[i].d_url, d_bodies[i], batch.held[i], started)
            if isinstance(reply, tuple):
                return reply
            try:
                answer = reply.json()
            except ValueError:
                answer = None
            if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
                logger.warning("decode engine %s answered without choices: %.300r", picks[i].d_url, reply.content)
                return "decode_malformed", openai_error(502, "the decode engine could not serve the request",
                                                        kind="upstream_error")
            if picks[i].p_url is None:
                with contextlib.suppress(ValueError):
                    self.placement.check_tokens(picks[i], answer)
            return answer

        answers = await self._all(batch, [self.spawn(decode(i)) for i in range(k)], cancel=True)
        failed = await self._batch_failure(endpoint, batch, answers)
        if failed is not None:
            return failed
        self.requests.labels(endpoint, "ok").inc()
        return JSONResponse(merge_completions(answers, n))

    async def _batch_failure(self, endpoint: str, batch: Batch, results: list) -> Response | None:
        """The first prompt's error answer among `results` (counted, every handoff of the request
        abandoned), or None when none failed."""

        failed = next((r for r in results if isinstance(r, tuple)), None)
        if failed is None:
            return None
        await batch.abandon("batch_failed")
        self.requests.labels(endpoint, failed[0]).inc()
        return failed[1]

    async def _all(self, batch: Batch, tasks: list[asyncio.Task], *, cancel: bool) -> list:
        """Every task's result, in order. With `cancel`, the first failure (an error answer)
        cancels the tasks still running. When this request is cancelled (the client left), the
        tasks are cancelled too (with `cancel`) and what is not D's is abandoned."""

        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if cancel and any(not t.cancelled() and (t.exception() is not None or isinstance(t.result(), tuple))
                                  for t in done):
                    for task in pending:
                        task.cancel()
                    if pending:
                        await asyncio.wait(pending)
                    break
        except BaseException:
            if cancel:
                for task in tasks:
                    task.cancel()
            batch.abandon_soon("client_gone")
            raise
        results = []
        for task in tasks:
            if task.cancelled():
                results.append(None)
            elif task.exception() is not None:
                await batch.abandon("batch_failed")
                raise task.exception()
            else:
                results.append(task.result())
        return results

    async def _stream_batch(self, endpoint: str, picks: list[Pick], d_bodies: list[dict], batch: Batch, n: int,
                            started: float) -> AsyncIterator[bytes]:
        """D's streamed answers for every prompt, merged as they come: each chunk's choices
        re-indexed (prompt's index × n + choice's), one id, the usage chunks (with
        `stream_options.include_usage`) summed into one, one `[DONE]`. An error for one prompt ends
        the stream after the error (the other prompts' handoffs are abandoned unless D's)."""

        k = len(d_bodies)
        queue: asyncio.Queue = asyncio.Queue()
        outcomes: dict[int, str] = {}

        async def produce(i: int) -> None:
            buffer = b""
            try:
                chunks = self._stream(endpoint, picks[i].d_url, d_bodies[i], batch.held[i], started,
                                      record=lambda outcome: outcomes.setdefault(i, outcome))
                async with contextlib.aclosing(chunks):
                    async for chunk in chunks:
                        buffer = (buffer + chunk).replace(b"\r\n", b"\n")
                        *events, buffer = buffer.split(b"\n\n")
                        for event in events:
                            queue.put_nowait((i, event))
                if buffer.strip():
                    queue.put_nowait((i, buffer))
            finally:
                queue.put_nowait((i, None))

        # (The tasks run their first step, into `_stream`, before this generator resumes: from
        # then on each answers for its handoff.)
        tasks = [self.spawn(produce(i)) for i in range(k)]
        outcome, ended, usages, usage_event, merged_id = "ok", 0, [], None, None
        try:
            while ended < k:
                i, event = await queue.get()
                if event is None:
                    ended += 1
                    continue
                payload = sse_json(event)
                if payload is None:
                    continue  # `[DONE]` (one is sent at the end), comments, anything not an event
                if "error" in payload:
                    batch.abandon_soon("batch_failed")
                    for task in tasks:
                        if task is not tasks[i]:
                            task.cancel()
                    yield b"data: " + compact(payload) + b"\n\n"
                    await asyncio.wait([tasks[i]], timeout=10.0)
                    outcome = outcomes.get(i, "ok")
                    outcome = "decode_error" if outcome == "ok" else outcome
                    return
                merged_id = merged_id or payload.get("id")
                if merged_id is not None:
                    payload["id"] = merged_id
                choices = payload.get("choices")
                if isinstance(choices, list) and not choices and isinstance(payload.get("usage"), dict):
                    usages.append(payload["usage"])
                    usage_event = payload
                    continue
                for choice in choices if isinstance(choices, list) else ():
                    if isinstance(choice, dict):
                        choice["index"] = i * n + int_or_zero(choice.get("index"))
                yield b"data: " + compact(payload) + b"\n\n"
            if usage_event is not None:
                usage_event["usage"] = sum_usage(usages)
                yield b"data: " + compact(usage_event) + b"\n\n"
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "client_gone"
            raise
        finally:
            # (All well, every handoff is D's by now; one D answered without a byte is abandoned.)
            batch.abandon_soon({"ok": "decode_failed", "client_gone": "client_gone"}.get(outcome, "batch_failed"))
            for task in tasks:
                task.cancel()
            self.requests.labels(endpoint, outcome).inc()

    async def health(self) -> Response:
        async def probe(url: str) -> bool:
            try:
                return (await self.client.get(f"{url}/health", timeout=3.0)).status_code == 200
            except httpx.HTTPError:
                return False

        urls = self.prefill_urls + self.decode_urls
        results = await asyncio.gather(*(probe(u) for u in urls))
        n_p = len(self.prefill_urls)
        healthy = any(results[:n_p]) and any(results[n_p:])
        # Counts only: engine addresses are internal (unauthenticated route).
        return JSONResponse(status_code=200 if healthy else 503, content={
            "healthy": healthy, "prefill": {"up": sum(results[:n_p]), "engines": n_p},
            "decode": {"up": sum(results[n_p:]), "engines": len(results) - n_p}})

    async def list_models(self) -> Response:
        await self.refresh_models()
        return JSONResponse({"object": "list", "data": [
            {"id": m, "object": "model", "owned_by": "kvbaton"} for m in sorted(self.models)]})

    async def metrics(self) -> Response:
        await self.refresh_sidecar_states()
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4")

    async def close(self) -> None:
        await self.placement.stop()
        if self._background:  # abandons under way
            await asyncio.wait(set(self._background), timeout=6.0)
        await self.client.aclose()
        await self.door_client.aclose()


class HeldStream(StreamingResponse):
    """A streamed answer that, once it is over however it ended, abandons what of its handoffs is
    not D's (a client that left before the stream began included) and gives its place in flight
    back, exactly once."""

    on_close = None

    def __init__(self, content, *, held: "Held | Batch", **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.held = held

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.held.abandon_soon("client_gone")
            release, self.on_close = self.on_close, None
            if release is not None:
                release()


def with_handoff(body: dict, params: dict | None) -> dict:
    """D's request: the client's, with P's handoff less the abandon capability, which stays with
    the router."""

    d_body = dict(body)
    if params:
        forwarded = dict(params)
        section = params.get("kvbaton")
        if isinstance(section, dict):
            # The abandon capability and the router's door are the router's, never D's.
            forwarded["kvbaton"] = {k: v for k, v in section.items() if k not in ("abandon", "router")}
        d_body["kv_transfer_params"] = forwarded
    return d_body


def compact(payload: dict) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


def int_or_zero(value) -> int:
    return value if type(value) is int else 0


def sum_usage(usages: list) -> dict | None:
    """The usage of several answers as one: counts added, nested counts too (vLLM's
    `prompt_tokens_details`)."""

    total: dict = {}
    for usage in usages:
        if not isinstance(usage, dict):
            continue
        for key, value in usage.items():
            if type(value) is int:
                total[key] = int_or_zero(total.get(key)) + value
            elif isinstance(value, dict):
                total[key] = sum_usage([total.get(key), value])
            else:
                total.setdefault(key, value)
    return total or None


def merge_completions(answers: list[dict], n: int) -> dict:
    """D's answers to the prompts of one request (in the prompts' order) as the one answer vLLM
    gives for them: choice `index` = prompt's index × n + the choice's own, usage summed, the first
    answer's id."""

    merged = dict(answers[0])
    choices = []
    for i, answer in enumerate(answers):
        for choice in answer.get("choices", []):
            if isinstance(choice, dict):
                choices.append({**choice, "index": i * n + int_or_zero(choice.get("index"))})
    merged["choices"] = sorted(choices, key=lambda choice: choice["index"])
    merged["usage"] = sum_usage([answer.get("usage") for answer in answers])
    return merged


def sse_json(event: bytes) -> dict | None:
    """The JSON object a server-sent event carries in its data lines, else None (`[DONE]`,
    comments, anything else)."""

    lines = [line[5:] for line in event.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    try:
        payload = json.loads(b"\n".join(lines))
    except (ValueError, RecursionError):
        return None
    return payload if isinstance(payload, dict) else None


def upstream_error(status: int, content: bytes, role: str, url: str) -> JSONResponse:
    """An engine's error, told to the client without the engine's address or internals: a 4xx
    keeps the engine's message when it is an OpenAI-shaped error (it is about the request, e.g. a
    prompt too long); anything else becomes a generic upstream error (details in the log)."""

    message = ""
    if 400 <= status < 500:
        try:
            error = json.loads(content).get("error")
            message = error.get("message", "") if isinstance(error, dict) else ""
        except (ValueError, AttributeError, RecursionError):
            message = ""
    if message and isinstance(message, str):
        return openai_error(status, message[:2000])
    logger.warning("%s engine %s answered %d: %.300r", role, url, status, content)
    return openai_error(502 if status >= 500 else status, f"the {role} engine could not serve the request",
                        kind="upstream_error")


async def sample_loop_lag(histogram, every_s: float = 0.05) -> None:
    """Observe how late the loop wakes a timer, every `every_s`, until cancelled."""

    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + every_s
        await asyncio.sleep(every_s)
        histogram.observe(max(0.0, loop.time() - due))


class RequireKey:
    """Answers 401 to an HTTP request without the router's API key (or, for /metrics, its
    metrics key); everything else passes through untouched."""

    def __init__(self, app, router: Router) -> None:
        self.app, self.router = app, router

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            request = Request(scope)
            refusal = self.refusal(request)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, request: Request) -> Response | None:
        router = self.router
        path = request.url.path
        if path == "/metrics" and router.metrics_key is not None:
            if not router.metrics_authorized(request):
                router.requests.labels("metrics", "unauthorized").inc()
                return openai_error(401, "missing or wrong metrics key (Authorization: Bearer KEY)",
                                    kind="invalid_request_error", code="invalid_api_key")
        elif path != "/health" and not router.authorized(request):
            router.requests.labels("any", "unauthorized").inc()
            return openai_error(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                kind="invalid_request_error", code="invalid_api_key")
        return None


def build_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.placement.start()  # the KV event feeds run on the server's loop
        lag = asyncio.get_running_loop().create_task(sample_loop_lag(router.loop_lag))
        try:
            yield
        finally:
            lag.cancel()
            await router.close()

    app = FastAPI(title="kvbaton router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    # A plain ASGI wrapper, not `@app.middleware("http")`: Starlette's BaseHTTPMiddleware moves
    # every streamed chunk through a memory stream and a task switch, a cost per token on the
    # router's one thread.
    app.add_middleware(RequireKey, router=router)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await router.handle(request, "/v1/chat/completions")

    @app.post("/v1/sessions/{session:path}/prefetch")
    async def session_prefetch(request: Request, session: str):
        return await router.session_call(request, session, "prefetch")

    @app.delete("/v1/sessions/{session:path}")
    async def session_close(request: Request, session: str):
        return await router.session_call(request, session, "close")

    @app.get("/v1/models")
    async def models():
        return await router.list_models()

    @app.get("/health")
    async def health():
        return await router.health()

    @app.get("/metrics")
    async def metrics():
        return await router.metrics()

    return app
