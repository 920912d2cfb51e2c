"""The seeded swarm simulator in CI: a few hundred sequences, zero violations and leaks, every
fault kind exercised; the volume runs live in `kvbaton fuzz`."""

from kvbaton.core.log import read_log
from kvbaton.core.replay import replay
from kvbaton.sim.fuzz import run_fuzz, write_log
from kvbaton.sim.swarm import FAULTS, Swarm


def test_swarm_is_clean_and_exercises_every_fault(tmp_path):
    report = run_fuzz(seed=1, sequences=600, steps=300, out=str(tmp_path))
    assert report.failures == []
    assert report.violations == 0 and report.leaks == 0
    missing = [name for name in FAULTS if report.faults.get(name, 0) == 0]
    assert missing == []


def test_swarm_is_deterministic_per_seed():
    a, b = Swarm(42).run(), Swarm(42).run()
    assert a.events == b.events and a.faults == b.faults


def test_fuzz_log_replays_to_the_recorded_hash(tmp_path):
    swarm = Swarm(9)
    swarm.run()
    for node in swarm.nodes.values():
        path = tmp_path / f"{node.name}.kvlog"
        write_log(str(path), node.log, swarm.config, node.name, hash_every=7)
        header, records = read_log(str(path))
        result = replay(header, records)
        assert result.first_divergence is None
        assert result.state_hash == node.ledger.state_hash()
