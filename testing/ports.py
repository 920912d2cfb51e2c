"""Ports for processes that must be told theirs before they start (`kvbaton serve`'s and the
demo's engines and router, the benches' stacks, the tests' engines and sidecars). A sidecar whose
control port is not set binds its own (SidecarConfig.address) and needs none of this."""

from __future__ import annotations

import random
import socket

__all__ = ["free_port", "reserve_ports"]

# Never the process-global `random`: vLLM seeds it (0 by default), so every engine on a host would
# draw the same ports.
_PORTS = random.SystemRandom()
# Ports this process handed out: each one is bound later by someone else, so a second draw of the
# same number (an engine's HTTP port and its sidecar's, say) would pass the bind check. vLLM's
# server socket and the sidecar's both allow port reuse, so such a pair shares the port silently
# and the kernel splits connections between them.
_HANDED_OUT: set[int] = set()


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
    """A port free now on `host`, never one this process handed out before, chosen below the
    kernel's ephemeral range when it can be.

    The port is bound later by another process (the sidecar, an engine). A port from the
    ephemeral range may be taken meanwhile by any outgoing connection on the machine, and that
    process then cannot bind it; ports below the range are only taken by programs that bind them
    on purpose."""

    low = _ephemeral_low()
    if low > 12000:
        for _ in range(64):
            port = _PORTS.randrange(10000, low)
            if port in _HANDED_OUT:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                _HANDED_OUT.add(port)
                return port
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise OSError(f"no free port on {host} that this process has not handed out already")
