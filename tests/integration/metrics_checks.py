"""Reading Prometheus text from an engine's sidecar (`metrics_port`), the router, or vLLM."""

from __future__ import annotations

import re
import time

import httpx

_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str) -> list[tuple[str, dict, float]]:
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        found = _SAMPLE.fullmatch(line)
        if found:
            out.append((found.group(1), dict(_LABEL.findall(found.group(3) or "")), float(found.group(4))))
    return out


def total(text: str, name: str, **labels) -> float:
    """The sum of the samples of `name` whose labels include `labels` (0 when none)."""

    return sum(v for n, got, v in samples(text) if n == name and all(got.get(k) == x for k, x in labels.items()))


def scrape(url: str) -> str:
    reply = httpx.get(url, timeout=30)
    reply.raise_for_status()
    return reply.text


def sidecar_url(port: int) -> str:
    return f"http://127.0.0.1:{port}/metrics"


def wait_sidecar(port: int, timeout_s: float = 60.0) -> str:
    """The sidecar's first scrape: it binds its metrics port a moment after the engine is healthy."""

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return scrape(sidecar_url(port))
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def open_records(text: str) -> float:
    """Open tickets, loads and leases in one sidecar's scrape."""

    return sum(total(text, name) for name in ("kvbaton_tickets", "kvbaton_loads", "kvbaton_leases"))


def wait_until(predicate, timeout_s: float = 30.0, poll_s: float = 0.5, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached in {timeout_s:.0f} s")
        time.sleep(poll_s)
