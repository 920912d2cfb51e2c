"""The P/D router: an OpenAI-compatible front for prefill and decode vLLM engines.

For each completion or chat request: send it to a prefill engine (P) with `max_tokens=1` and
`kv_transfer_params={"do_remote_decode": true}`, take the handoff P returns, send the original
request to a decode engine (D) with it, and return (or stream) D's answer. Which P and D, and
whether P is needed at all (D alone when it already holds most of the prompt), is `routing.py`'s
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
flight are bounded (429), and upstream failures are answered without internal addresses or
exception text (those go to the router's log).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from .metrics import RoutingMetrics
from .routing import CacheRouting, Pick, RoutingCollector, RoutingConfig

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
# The router refreshes sidecar states for /metrics at most this often.
STATE_REFRESH_S = 5.0


def _short(ident) -> str:
    text = str(ident or "")
    return text[:8] + "…" if len(text) > 10 else text


class BadRequest(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class Router:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], *, timeout_s: float = 600.0,
                 models: list[str] | None = None, api_key: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                 routing: RoutingConfig | None = None) -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("the router needs at least one prefill and one decode engine URL")
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in decode_urls]
        self.timeout_s = timeout_s
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes
        self.max_in_flight = max_in_flight
        self.active = 0
        self._states_at = float("-inf")
        self.models = set(models or [])
        self.controls: dict[str, str] = {}  # P engine id -> its sidecar address (learned from handoffs)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))
        self.registry = CollectorRegistry()
        self.requests = Counter("kvbaton_router_requests", "Requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=self.registry)
        self.abandons = Counter("kvbaton_router_abandons", "Tickets the router abandoned, by cause",
                                ["cause"], registry=self.registry)
        self.in_flight = Gauge("kvbaton_router_in_flight", "Requests in flight", registry=self.registry)
        self.ttft = Histogram("kvbaton_router_ttft_seconds", "Time to the first byte of D's answer",
                              registry=self.registry,
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.prefill_time = Histogram("kvbaton_router_prefill_seconds", "Time P took to answer",
                                      registry=self.registry,
                                      buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.registry.register(EngineSidecarCollector(self))
        self.routing = RoutingMetrics(self.registry)
        # Which engines serve a request (cache-aware, or round robin with routing="round-robin").
        self.placement = CacheRouting(routing or RoutingConfig(mode="round-robin"), self.prefill_urls,
                                      self.decode_urls)
        self.registry.register(RoutingCollector(self.placement))
        self._states: dict[str, dict] = {}
        # The control-plane client's imports happen here, at startup: done lazily by the first
        # abandon or state refresh, they ran inside the event loop and stalled every request.
        from ..control.client import load_xoscar_eagerly

        load_xoscar_eagerly()

    # -- helpers ---------------------------------------------------------------------------------

    async def refresh_models(self) -> None:
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

    async def refresh_sidecar_states(self) -> None:
        from ..control.client import call_authority

        if time.monotonic() - self._states_at < STATE_REFRESH_S and set(self.controls) <= set(self._states):
            return
        self._states_at = time.monotonic()
        for engine, address in list(self.controls.items()):
            try:
                self._states[engine] = await call_authority(address, "debug_state", timeout_s=2.0)
            except Exception as exc:
                logger.warning("could not read the state of sidecar %s: %r", address, exc)
                self._states[engine] = {"error": "unreachable"}

    async def abandon(self, params: dict | None, cause: str) -> None:
        """Give P's blocks back now (the ticket is unclaimed): with the capability P gave only
        to the router (`abandon` in P's answer, never forwarded)."""

        section = (params or {}).get("kvbaton")
        if not isinstance(section, dict) or not isinstance(section.get("abandon"), str):
            return
        from ..control.client import call_authority

        try:
            closed = await call_authority(section["control"], "abandon", section["ticket"], section["abandon"],
                                          timeout_s=5.0)
            self.abandons.labels(cause if closed else cause + "_already_claimed").inc()
        except Exception as exc:
            self.abandons.labels(cause + "_unreachable").inc()
            logger.warning("could not abandon ticket %s on %s: %r", _short(section.get("ticket")),
                           section.get("control"), exc)

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
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BadRequest(413, f"the request body is larger than {self.max_body_bytes} bytes")
            chunks.append(chunk)
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
                # A stream holds its place until it is over, however it ends (a client that
                # leaves before its first byte included).
                response.on_close = self._release
                streaming = True
            return response
        finally:
            if not streaming:
                self._release()

    def _release(self) -> None:
        self.active -= 1
        self.in_flight.dec()


    async def _handle(self, request: Request, endpoint: str) -> Response:
        try:
            body = await self.read_body(request)
        except BadRequest as exc:
            self.requests.labels(endpoint, "too_large" if exc.status == 413 else "bad_request").inc()
            return openai_error(exc.status, exc.message)
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
        pick = await self.placement.pick(endpoint, body)
        self.routing.routed(None if pick.p_url is None else pick.how, disaggregated=pick.p_url is not None)
        if n > 1:
            self.routing.parallel(n)
        return await self._route(request, endpoint, body, pick.p_url, pick.d_url, pick)

    async def _route(self, request: Request, endpoint: str, body: dict, p_url: str | None, d_url: str,
                     pick: Pick | None = None) -> Response:
        started = time.perf_counter()
        params = None
        d_body = dict(body)
        if p_url is not None:
            prefilled = await self._prefill(endpoint, body, p_url, started, pick)
            if isinstance(prefilled, Response):
                return prefilled
            params = prefilled
        # (p_url None: D alone, it holds most of the prompt; no handoff, nothing to abandon.)
        section = (params or {}).get("kvbaton")
        if params:
            forwarded = dict(params)
            if isinstance(section, dict):  # the abandon capability stays with the router
                forwarded["kvbaton"] = {k: v for k, v in section.items() if k != "abandon"}
            d_body["kv_transfer_params"] = forwarded
        if await request.is_disconnected():
            await self.abandon(params, "client_gone")
            self.requests.labels(endpoint, "client_gone").inc()
            return Response(status_code=499)
        if body.get("stream"):
            return HeldStream(self._stream(request, endpoint, d_url, d_body, params, started),
                              media_type="text/event-stream")
        d_reply = None
        for attempt, url in enumerate(self._decode_order(d_url)):
            try:
                with self.placement.busy(url):
                    d_reply = await self.client.post(f"{url}{endpoint}", json=d_body)
                break
            except httpx.TransportError as exc:
                # D is down. The handoff is still good for another D: unclaimed, it is claimed
                # there; claimed by the dead D, the claim is refused and that D recomputes.
                logger.warning("decode engine %s failed (%r); trying the next one", url, exc)
                if attempt == len(self.decode_urls) - 1:
                    await self.abandon(params, "decode_failed")
                    self.requests.labels(endpoint, "decode_unreachable").inc()
                    return openai_error(502, "the decode engines are unreachable", kind="upstream_error")
        self.ttft.observe(time.perf_counter() - started)
        if d_reply.status_code != 200:
            await self.abandon(params, "decode_failed")
            self.requests.labels(endpoint, f"decode_{d_reply.status_code}").inc()
            return upstream_error(d_reply.status_code, d_reply.content, "decode", url)
        if p_url is None and pick is not None:
            with contextlib.suppress(ValueError):
                self.placement.check_tokens(pick, d_reply.json())
        self.requests.labels(endpoint, "ok").inc()
        return Response(d_reply.content, status_code=d_reply.status_code, media_type="application/json")

    async def _prefill(self, endpoint: str, body: dict, p_url: str, started: float,
                       pick: Pick | None) -> dict | None | Response:
        """P computes the prompt (max_tokens=1) and answers with the handoff: its
        kv_transfer_params (None when it gave none), or the error Response for the client."""

        p_body = dict(body)
        # n > 1 is one prefill and one handoff: P computes the prompt once (n=1 there, so one
        # ticket), D samples n times from it (its children share the one handoff, see
        # PROTOCOL.md).
        p_body.update({"max_tokens": 1, "stream": False, "n": 1, "kv_transfer_params": {"do_remote_decode": True}})
        p_body.pop("best_of", None)
        if "max_completion_tokens" in p_body:
            p_body["max_completion_tokens"] = 1
        p_body.pop("stream_options", None)
        p_body["request_id"] = f"kvb-{uuid.uuid4().hex}"
        try:
            with self.placement.busy(p_url):
                p_reply = await self.client.post(f"{p_url}{endpoint}", json=p_body)
        except httpx.HTTPError as exc:
            self.requests.labels(endpoint, "prefill_unreachable").inc()
            logger.warning("prefill engine %s failed: %r", p_url, exc)
            return openai_error(502, "the prefill engine is unreachable", kind="upstream_error")
        if p_reply.status_code != 200:
            self.requests.labels(endpoint, f"prefill_{p_reply.status_code}").inc()
            return upstream_error(p_reply.status_code, p_reply.content, "prefill", p_url)
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
        if isinstance(section, dict) and section.get("engine") and section.get("control"):
            self.controls[str(section["engine"])] = str(section["control"])
            self.placement.watch_history(p_url, str(section["control"]))
        return params

    def _decode_order(self, first: str) -> list[str]:
        index = self.decode_urls.index(first)
        return self.decode_urls[index:] + self.decode_urls[:index]

    async def _stream(self, request: Request, endpoint: str, d_url: str, d_body: dict, params: dict | None,
                      started: float) -> AsyncIterator[bytes]:
        sent = False
        outcome = "ok"
        order = self._decode_order(d_url)
        try:
            for attempt, url in enumerate(order):
                try:
                    with self.placement.busy(url):
                        async with self.client.stream("POST", f"{url}{endpoint}", json=d_body) as reply:
                            if reply.status_code != 200:
                                outcome = f"decode_{reply.status_code}"
                                await self.abandon(params, "decode_failed")
                                payload = await reply.aread()
                                error = upstream_error(reply.status_code, payload, "decode", url)
                                yield b"data: " + error.body + b"\n\n"
                                return
                            async for chunk in reply.aiter_bytes():
                                if not sent:
                                    self.ttft.observe(time.perf_counter() - started)
                                    sent = True
                                yield chunk
                    return
                except httpx.TransportError as exc:
                    if not sent and attempt < len(order) - 1:
                        logger.warning("decode engine %s failed (%r); trying the next one", url, exc)
                        continue
                    outcome = "decode_unreachable"
                    await self.abandon(params, "decode_failed")
                    logger.warning("decode engine %s failed mid-stream: %r", url, exc)
                    error = {"error": {"message": "the decode engine failed", "type": "upstream_error"}}
                    yield f"data: {json.dumps(error)}\n\n".encode()
                    return
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away mid-stream. Nothing may be awaited here (the task is being
            # cancelled), so the abandon runs on its own. Once D sent a token it had claimed the
            # ticket (or recomputed), which is then D's to release: no call. (A client that
            # closes right after `[DONE]` lands here too, and cost a sidecar call per request.)
            outcome = "client_gone"
            if not sent:
                asyncio.get_running_loop().create_task(self.abandon(params, "client_gone"))
            raise
        finally:
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
        await self.client.aclose()


class HeldStream(StreamingResponse):
    """A streamed answer that gives its place in flight back exactly once when it is over."""

    on_close = None

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            release, self.on_close = self.on_close, None
            if release is not None:
                release()


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


def build_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.placement.start()  # the KV event feeds run on the server's loop
        yield
        await router.close()

    app = FastAPI(title="kvbaton router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        if request.url.path != "/health" and not router.authorized(request):
            router.requests.labels("any", "unauthorized").inc()
            return openai_error(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                kind="invalid_request_error", code="invalid_api_key")
        return await call_next(request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await router.handle(request, "/v1/chat/completions")

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
