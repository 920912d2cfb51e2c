"""kvbaton.testing.ports.free_port never hands one process the same port twice: an engine's HTTP
port and its sidecar's control port drawn alike would both bind (each allows port reuse) and split
its connections; and it never draws from the process-global random, which vLLM seeds."""

from __future__ import annotations

import itertools

import pytest

from kvbaton.testing import ports


@pytest.fixture(autouse=True)
def own_book(tmp_path, monkeypatch):
    """Each test its own host-wide book, so ports other runs handed out do not count here."""

    monkeypatch.setattr(ports, "_shared_path", lambda: str(tmp_path / "ports"))


def test_a_port_is_handed_out_once_even_when_the_draw_repeats(monkeypatch):
    monkeypatch.setattr(ports, "_HANDED_OUT", set())
    monkeypatch.setattr(ports._PORTS, "randrange", lambda low, high: 23456)
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 32768)
    first, second, third = (ports.free_port("127.0.0.1") for _ in range(3))
    assert first == 23456
    assert len({first, second, third}) == 3  # the later ones fall back to the kernel's choice


def test_served_engines_ports_never_collide_and_metrics_ports_follow_the_base(monkeypatch):
    from kvbaton.deploy.serve import plan_engines

    monkeypatch.setattr(ports, "_HANDED_OUT", set())
    # The draw offers engine and metrics ports first; free_port passes them over.
    draws = itertools.chain([8100, 9100, 8101, 9102], itertools.count(20001))
    monkeypatch.setattr(ports._PORTS, "randrange", lambda low, high: next(draws))
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 32768)
    specs = plan_engines(2, 1, "cpu", 1 << 20, None, None, engine_port_base=8100, metrics_port_base=9100)
    assert [s.port for s in specs] == [8100, 8101, 8102]
    assert [s.extra_config["metrics_port"] for s in specs] == [9100, 9101, 9102]
    assert [s.control_port for s in specs] == [20001, 20002, 20003]
    assert all("metrics_port" not in s.extra_config
               for s in plan_engines(1, 1, "cpu", 1 << 20, None, None, engine_port_base=8200))


def test_free_port_ignores_the_seeded_global_random():
    import random

    random.seed(0)
    first = ports.free_port("127.0.0.1")
    random.seed(0)
    picks = {ports.free_port("127.0.0.1") for _ in range(5)} | {first}
    assert len(picks) > 1


def test_two_processes_planning_at_once_never_get_one_port(monkeypatch):
    """Another process of this user (its own set of handed-out ports, one host-wide book): a
    port one of them handed out is passed over by the other until it has surely been bound."""

    monkeypatch.setattr(ports._PORTS, "randrange", lambda low, high: 23456)
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 32768)
    monkeypatch.setattr(ports, "_HANDED_OUT", set())
    first = ports.free_port("127.0.0.1")
    monkeypatch.setattr(ports, "_HANDED_OUT", set())  # the other process
    second = ports.free_port("127.0.0.1")
    assert first == 23456 and second != 23456
    monkeypatch.setattr(ports.time, "time", lambda: 1e12)  # long after: the book has forgotten it
    monkeypatch.setattr(ports, "_HANDED_OUT", set())
    assert ports.free_port("127.0.0.1") == 23456
