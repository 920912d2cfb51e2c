"""The engines' event logs, checked the same way by every test module that runs real engines."""

from __future__ import annotations

from kvbaton.core.log import read_log
from kvbaton.core.replay import replay


def replay_engine_logs(events_dir, engines: int) -> set[str]:
    """Replay every engine's event log: events, no violation, no divergence from the recorded
    state hashes. Returns the event kinds the logs hold."""

    logs = sorted(events_dir.glob("*.kvlog"))
    assert len(logs) == engines, logs
    kinds: set[str] = set()
    for path in logs:
        header, records = read_log(str(path))
        result = replay(header, records)
        assert result.events > 0
        assert result.violating_events == 0 and result.first_divergence is None, path
        kinds.update(type(record.event).__name__ for record in records if record.event is not None)
    return kinds
