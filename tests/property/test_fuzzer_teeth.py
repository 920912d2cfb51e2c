"""The simulator has teeth: each deliberately broken ledger is caught within a bounded number of
sequences, its failing log shrinks small, and the shrunk log replays to the same violation."""

import pytest

from kvbaton.core.ledger import Ledger
from kvbaton.core.log import read_log
from kvbaton.core.replay import replay
from kvbaton.sim.fuzz import run_fuzz

from .broken_ledgers import BROKEN


@pytest.mark.parametrize("broken", BROKEN, ids=lambda cls: cls.__name__)
def test_simulator_catches_broken_ledger(broken, tmp_path):
    report = run_fuzz(seed=3, sequences=400, steps=300, out=str(tmp_path), ledger_factory=broken)
    assert report.failures, f"{broken.__name__} survived {report.sequences} sequences"
    failure = report.failures[0]
    assert report.sequences <= 400
    assert failure["events"] <= 40, f"shrunk log still has {failure['events']} events"
    header, records = read_log(failure["log"])
    broken_result = replay(header, records, ledger_factory=broken)
    assert broken_result.first_violation is not None, "the shrunk log no longer shows the bug"
    # The same events are fine for the correct ledger: the violation is the bug's, not the log's.
    healthy = replay(header, records, ledger_factory=Ledger)
    assert healthy.first_violation is None, healthy.first_violation.violations
