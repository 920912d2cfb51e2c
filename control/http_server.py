"""The sidecar's two small HTTP listeners (metrics, the router's door) share one bounded server.

Each connection carries one request and is closed after the answer. A listener holds at most
`max_connections` at a time (503 past it), reads a request's head and body within
`timeout_s`, refuses heads and bodies over their bounds unread, and never lets a handler's bug
take the sidecar down (500, logged): the ports cannot be used to hold the sidecar's memory or
connections.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

logger = logging.getLogger("kvbaton.sidecar")

# (status line, content type, body, extra headers)
Response = tuple[str, str, bytes, dict]
# handler(method, path, headers with lowercase names, body) -> Response
Handler = Callable[[str, str, dict, bytes], Response]


def plain(status: str, text: str = "") -> Response:
    return status, "text/plain", text.encode(), {}


async def serve(host: str, port: int, handler: Handler, *, max_connections: int, timeout_s: float = 5.0,
                max_head_bytes: int = 8192, max_body_bytes: int = 0, what: str = "a request") -> asyncio.AbstractServer:
    """Serve `handler` at host:port (0: the kernel chooses); raises OSError when the port cannot
    be bound. `max_body_bytes` 0: requests carry no body."""

    active = 0

    async def send(writer: asyncio.StreamWriter, response: Response, head_only: bool = False) -> None:
        status, content_type, body, headers = response
        head = f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        head += "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        writer.write((head + "Connection: close\r\n\r\n").encode() + (b"" if head_only else body))
        await writer.drain()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal active
        active += 1
        try:
            if active > max_connections:
                await send(writer, plain("503 Service Unavailable", "busy\n"))
                return
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
            lines = head.decode("latin-1").split("\r\n")
            method, _, rest = lines[0].partition(" ")
            path = rest.split(" ", 1)[0].split("?", 1)[0]
            headers = {}
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if sep:
                    headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0") or 0)
            if not 0 <= length <= max_body_bytes:
                await send(writer, plain("413 Payload Too Large"))
                return
            body = await asyncio.wait_for(reader.readexactly(length), timeout_s) if length else b""
            await send(writer, handler(method, path, headers, body), head_only=method == "HEAD")
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError, UnicodeError, ValueError):
            pass  # a client that sent no proper request, too slowly, or went away: nothing to say
        except Exception:  # a handler's bug must not take the sidecar down
            logger.exception("answering %s failed", what)
            try:
                await send(writer, plain("500 Internal Server Error"))
            except Exception:  # noqa: BLE001 - the client is gone too
                pass
        finally:
            active -= 1
            writer.close()

    return await asyncio.start_server(handle, host, port, limit=max_head_bytes)
