"""Ports for processes that must be told theirs before they start (`kvbaton serve`'s and the
demo's engines and router, the benches' stacks, the tests' engines and sidecars). A sidecar whose
control port is not set binds its own (SidecarConfig.address) and needs none of this."""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
import time
from contextlib import contextmanager

__all__ = ["free_port", "reserve_ports"]

# Never the process-global `random`: vLLM seeds it (0 by default), so every engine on a host would
# draw the same ports.
_PORTS = random.SystemRandom()
# Ports this process handed out: each one is bound later by someone else, so a second draw of the
# same number (an engine's HTTP port and its sidecar's, say) would pass the bind check. vLLM's
# server socket and the sidecar's both allow port reuse, so such a pair shares the port silently
# and the kernel splits connections between them.
_HANDED_OUT: set[int] = set()


# Ports handed out by any process of this user on this host, for a while: two processes that plan
# ports at once (two deployments, two test runs) must not both pick one that is still free
# because neither has bound it yet.
SHARED_HOLD_S = 600.0


def _shared_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"kvbaton-ports-{os.getuid()}")


@contextmanager
def _shared_ports():
    """The host-wide book of recently handed-out ports (port -> when), locked while open; a book
    that cannot be opened is an empty one (this process's own set still holds)."""

    try:
        fd = os.open(_shared_path(), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        yield {}
        return
    if os.fstat(fd).st_uid != os.getuid():  # someone else's file under our name: not our book
        os.close(fd)
        yield {}
        return
    with os.fdopen(fd, "r+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        now = time.time()
        book: dict[int, float] = {}
        for line in handle.read().split():
            port, _, when = line.partition(":")
            try:
                if now - float(when) < SHARED_HOLD_S:
                    book[int(port)] = float(when)
            except ValueError:
                continue
        yield book
        handle.seek(0)
        handle.truncate()
        handle.write("".join(f"{port}:{when:.0f}\n" for port, when in book.items()))


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def reserve_ports(ports) -> None:
    """Ports this process will give out by other means (an engine's fixed HTTP port): free_port
    never returns them."""
    _HANDED_OUT.update(int(port) for port in ports)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on `host`, never one this process handed out before nor one another
    process of this user handed out in the last SHARED_HOLD_S, chosen below the kernel's
    ephemeral range when it can be.

    The port is bound later by another process (the sidecar, an engine). A port from the
    ephemeral range may be taken meanwhile by any outgoing connection on the machine, and that
    process then cannot bind it; ports below the range are only taken by programs that bind them
    on purpose."""

    with _shared_ports() as shared:
        port = _pick(host, shared)
        shared[port] = time.time()
    _HANDED_OUT.add(port)
    return port


def _pick(host: str, shared: dict) -> int:
    taken = _HANDED_OUT.union(shared)
    low = _ephemeral_low()
    if low > 12000:
        for _ in range(64):
            port = _PORTS.randrange(10000, low)
            if port in taken:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in taken:
            return port
    raise OSError(f"no free port on {host} that was not handed out already")
