"""free_port never hands one process the same port twice: an engine's HTTP port and its sidecar's
control port drawn alike would both bind (each allows port reuse) and split its connections."""

from __future__ import annotations

import itertools

from kvbaton.control import client


def test_a_port_is_handed_out_once_even_when_the_draw_repeats(monkeypatch):
    monkeypatch.setattr(client, "_HANDED_OUT", set())
    monkeypatch.setattr(client._PORTS, "randrange", lambda low, high: 23456)
    monkeypatch.setattr(client, "_ephemeral_low", lambda: 32768)
    first, second, third = (client.free_port("127.0.0.1") for _ in range(3))
    assert first == 23456
    assert len({first, second, third}) == 3  # the later ones fall back to the kernel's choice


def test_served_engines_ports_never_collide_and_metrics_ports_follow_the_base(monkeypatch):
    from kvbaton.deploy.serve import plan_engines

    monkeypatch.setattr(client, "_HANDED_OUT", set())
    # The draw offers engine and metrics ports first; free_port passes them over.
    draws = itertools.chain([8100, 9100, 8101, 9102], itertools.count(20001))
    monkeypatch.setattr(client._PORTS, "randrange", lambda low, high: next(draws))
    monkeypatch.setattr(client, "_ephemeral_low", lambda: 32768)
    specs = plan_engines(2, 1, "cpu", 1 << 20, None, None, engine_port_base=8100, metrics_port_base=9100)
    assert [s.port for s in specs] == [8100, 8101, 8102]
    assert [s.extra_config["metrics_port"] for s in specs] == [9100, 9101, 9102]
    assert [s.control_port for s in specs] == [20001, 20002, 20003]
    assert all("metrics_port" not in s.extra_config
               for s in plan_engines(1, 1, "cpu", 1 << 20, None, None, engine_port_base=8200))
