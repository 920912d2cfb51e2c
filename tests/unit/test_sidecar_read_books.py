"""D's sidecar books where its reads spent their time, as the transport reports it per read
(queued, describe, initialize, transfer call, settle, collect, settle_busy): summed over the good
reads that say."""

from __future__ import annotations

import pytest

from kvbaton.control import messages as m

from kvbaton.testing.fake_io import listed_sidecar


def test_read_phases_are_summed_over_the_good_reads_that_report_them(tmp_path):
    a = listed_sidecar(tmp_path, "D", "consumer")
    a.on_message(m.ReadDone("r1", "x", True, "", 100, 0.010, 3, False, (0.001, 0.002, 0.0005, 0.003, 0.004, 0.005, 0.001)))
    a.on_message(m.ReadDone("r2", "y", True, "", 100, 0.020, 3, False, (0.002, 0.0, 0.001, 0.010, 0.008, 0.001, 0.002)))
    a.on_message(m.ReadDone("r3", "z", True, "", 100, 0.030, 3, False))  # a transport that does not say
    a.on_message(m.ReadDone("r4", "w", False, "boom", 0, 0.0, 0, False, (0.1,) * 7))
    books = a.transfer
    assert (books["reads"], books["failed"], books["phased_reads"]) == (4, 1, 2)
    assert books["bytes"] == 300 and books["seconds"] == pytest.approx(0.060)
    sums = {phase: books[f"{phase}_seconds"] for phase in m.READ_PHASES}
    assert sums == pytest.approx({"queued": 0.003, "describe": 0.002, "initialize": 0.0015, "transfer_call": 0.013,
                                  "settle": 0.012, "collect": 0.006, "settle_busy": 0.003})
