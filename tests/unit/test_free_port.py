"""free_port never hands one process the same port twice: an engine's HTTP port and its sidecar's
control port drawn alike would both bind (each allows port reuse) and split its connections."""

from __future__ import annotations

from kvbaton.control import client


def test_a_port_is_handed_out_once_even_when_the_draw_repeats(monkeypatch):
    monkeypatch.setattr(client, "_HANDED_OUT", set())
    monkeypatch.setattr(client._PORTS, "randrange", lambda low, high: 23456)
    monkeypatch.setattr(client, "_ephemeral_low", lambda: 32768)
    first, second, third = (client.free_port("127.0.0.1") for _ in range(3))
    assert first == 23456
    assert len({first, second, third}) == 3  # the later ones fall back to the kernel's choice
