"""The P/D router: an OpenAI-compatible front for prefill and decode vLLM engines.

For each completion or chat request: send it to a prefill engine (P) with `max_tokens=1` and
`kv_transfer_params={"do_remote_decode": true}`, take the handoff P returns, send the original
request to a decode engine (D) with it, and return (or stream) D's answer. Round robin over P and
D engines. When D fails, the client goes away or the request times out after P answered, the
router abandons the ticket on P's sidecar so P's blocks come back at once (a claimed ticket belongs
to D, which releases it itself).

The router keeps no state but requests in flight. `/metrics` serves Prometheus metrics: the
router's own and, at scrape time, each known P sidecar's open tickets and counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
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


class Router:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], *, timeout_s: float = 600.0,
                 models: list[str] | None = None) -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("the router needs at least one prefill and one decode engine URL")
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in decode_urls]
        self._next_p = itertools.cycle(range(len(self.prefill_urls)))
        self._next_d = itertools.cycle(range(len(self.decode_urls)))
        self.timeout_s = timeout_s
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

        for engine, address in list(self.controls.items()):
            try:
                self._states[engine] = await call_authority(address, "debug_state", timeout_s=2.0)
            except Exception as exc:
                self._states[engine] = {"error": str(exc)}

    async def abandon(self, params: dict | None, cause: str) -> None:
        section = (params or {}).get("kvbaton")
        if not isinstance(section, dict):
            return
        from ..control.client import call_authority

        try:
            closed = await call_authority(section["control"], "abandon", section["ticket"], timeout_s=5.0)
            self.abandons.labels(cause if closed else cause + "_already_claimed").inc()
        except Exception as exc:
            self.abandons.labels(cause + "_unreachable").inc()
            logger.warning("could not abandon ticket %s on %s: %r", section.get("ticket"), section.get("control"), exc)

    # -- the request path ------------------------------------------------------------------------

    async def handle(self, request: Request, endpoint: str) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            self.requests.labels(endpoint, "bad_request").inc()
            return openai_error(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            self.requests.labels(endpoint, "bad_request").inc()
            return openai_error(400, "the request body must be a JSON object")
        await self.refresh_models()
        model = body.get("model")
        if self.models and model not in self.models:
            self.requests.labels(endpoint, "unknown_model").inc()
            return openai_error(404, f"The model `{model}` does not exist (served: {sorted(self.models)}).",
                                param="model", code="model_not_found")
        if body.get("n", 1) not in (1, None):
            self.requests.labels(endpoint, "bad_request").inc()
            return openai_error(400, "n > 1 is not supported by the kvbaton router yet", param="n")
        p_url = self.prefill_urls[next(self._next_p)]
        d_url = self.decode_urls[next(self._next_d)]
        self.in_flight.inc()
        try:
            return await self._route(request, endpoint, body, p_url, d_url)
        finally:
            self.in_flight.dec()

    async def _route(self, request: Request, endpoint: str, body: dict, p_url: str, d_url: str) -> Response:
        started = time.perf_counter()
        p_body = dict(body)
        p_body.update({"max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}})
        if "max_completion_tokens" in p_body:
            p_body["max_completion_tokens"] = 1
        p_body.pop("stream_options", None)
        p_body["request_id"] = body.get("request_id") or f"kvb-{uuid.uuid4().hex}"
        try:
            p_reply = await self.client.post(f"{p_url}{endpoint}", json=p_body)
        except httpx.HTTPError as exc:
            self.requests.labels(endpoint, "prefill_unreachable").inc()
            return openai_error(502, f"prefill engine {p_url} failed: {exc}", kind="upstream_error")
        if p_reply.status_code != 200:
            self.requests.labels(endpoint, f"prefill_{p_reply.status_code}").inc()
            return Response(p_reply.content, status_code=p_reply.status_code, media_type="application/json")
        self.prefill_time.observe(time.perf_counter() - started)
        params = p_reply.json().get("kv_transfer_params")
        section = (params or {}).get("kvbaton")
        if isinstance(section, dict) and section.get("engine") and section.get("control"):
            self.controls[section["engine"]] = section["control"]
        d_body = dict(body)
        if params:
            d_body["kv_transfer_params"] = params
        if await request.is_disconnected():
            await self.abandon(params, "client_gone")
            self.requests.labels(endpoint, "client_gone").inc()
            return Response(status_code=499)
        if body.get("stream"):
            return StreamingResponse(self._stream(request, endpoint, d_url, d_body, params, started),
                                     media_type="text/event-stream")
        d_reply = None
        for attempt, url in enumerate(self._decode_order(d_url)):
            try:
                d_reply = await self.client.post(f"{url}{endpoint}", json=d_body)
                break
            except httpx.TransportError as exc:
                # D is down. The handoff is still good for another D: unclaimed, it is claimed
                # there; claimed by the dead D, the claim is refused and that D recomputes.
                logger.warning("decode engine %s failed (%r); trying the next one", url, exc)
                if attempt == len(self.decode_urls) - 1:
                    await self.abandon(params, "decode_failed")
                    self.requests.labels(endpoint, "decode_unreachable").inc()
                    return openai_error(502, f"decode engines failed: {exc}", kind="upstream_error")
        self.ttft.observe(time.perf_counter() - started)
        if d_reply.status_code != 200:
            await self.abandon(params, "decode_failed")
            self.requests.labels(endpoint, f"decode_{d_reply.status_code}").inc()
        else:
            self.requests.labels(endpoint, "ok").inc()
        return Response(d_reply.content, status_code=d_reply.status_code, media_type="application/json")

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
                    async with self.client.stream("POST", f"{url}{endpoint}", json=d_body) as reply:
                        if reply.status_code != 200:
                            outcome = f"decode_{reply.status_code}"
                            await self.abandon(params, "decode_failed")
                            payload = await reply.aread()
                            yield b"data: " + payload + b"\n\n"
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
                    error = {"error": {"message": f"decode engine {url} failed: {exc!r}", "type": "upstream_error"}}
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
        status = {u: ok for u, ok in zip(urls, results)}
        healthy = any(results[: len(self.prefill_urls)]) and any(results[len(self.prefill_urls):])
        return JSONResponse(status_code=200 if healthy else 503, content={"healthy": healthy, "engines": status})

    async def list_models(self) -> Response:
        await self.refresh_models()
        return JSONResponse({"object": "list", "data": [
            {"id": m, "object": "model", "owned_by": "kvbaton"} for m in sorted(self.models)]})

    async def metrics(self) -> Response:
        await self.refresh_sidecar_states()
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4")

    async def close(self) -> None:
        await self.client.aclose()


def build_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await router.close()

    app = FastAPI(title="kvbaton router", lifespan=lifespan)

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
