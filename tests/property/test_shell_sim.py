"""The simulator on the real shell (sim/shell.py): the sidecars' own stamping, effect carrying,
claim retries, read calls and heartbeats, on a virtual clock and a simulated network."""

from __future__ import annotations

import pytest

pytest.importorskip("xoscar")
pytest.importorskip("zmq")

from kvbaton.sim.shell import BREAKS, World, run_shell_fuzz  # noqa: E402


def test_the_real_shell_survives_every_fault_and_leaves_nothing_behind():
    report = run_shell_fuzz(seed=7, sequences=300)
    assert report["failures"] == [] and report["sequences"] == 300
    # Every fault the world can inject was injected, or the run proved little.
    assert all(count > 0 for count in report["faults"].values()), report["faults"]
    # Reads that ended past their pin were confirmed with P: some P still held, some it had let go.
    outcomes = report["outcomes"]
    assert outcomes["reads_confirmed"] > outcomes["reads_unpinned"] > 0, outcomes


@pytest.mark.parametrize("broken", BREAKS)
def test_a_deliberately_broken_shell_is_caught_within_a_bounded_number_of_sequences(broken):
    report = run_shell_fuzz(seed=1, sequences=100, broken=broken)
    assert report["violations"] == 1, f"the {broken} shell went unnoticed for 100 sequences"


def test_a_sequence_replays_exactly_from_its_seed():
    def run(seed: int):
        world = World(seed)
        result = world.run()
        return result, [engine.sidecar.ledger.state_hash() for engine in world.engines]

    (first, first_hashes), (second, second_hashes) = run(1234), run(1234)
    assert first.events == second.events > 0 and first_hashes == second_hashes
    assert first.faults == second.faults and first.violations == second.violations == []
