"""The event log: framing, error messages for damaged logs, golden logs of every schema version."""

import json
import pathlib
import subprocess
import sys

import msgspec
import pytest

from kvbaton.core import events as ev
from kvbaton.core.ledger import STATE_HASH_VERSION, Ledger, LedgerConfig
from kvbaton.core.log import MAGIC, LogError, LogHeader, LogWriter, Record, _frame, read_log
from kvbaton.core.replay import replay
from kvbaton.sim.fuzz import write_log
from kvbaton.sim.swarm import Swarm

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden"


def _sample_log(path, hash_every=5):
    swarm = Swarm(5, steps=200)
    swarm.run()
    write_log(str(path), swarm.p.log, swarm.config, "P0", hash_every=hash_every)
    return swarm


def test_roundtrip_keeps_every_event_and_the_hash(tmp_path):
    swarm = _sample_log(tmp_path / "p.kvlog")
    header, records = read_log(str(tmp_path / "p.kvlog"))
    assert header.config == swarm.config
    events = [r.event for r in records if r.event is not None]
    assert events == swarm.p.log
    result = replay(header, records)
    assert result.first_divergence is None
    assert result.state_hash == swarm.p.ledger.state_hash()


def test_replay_is_deterministic_across_runs(tmp_path):
    _sample_log(tmp_path / "a.kvlog")
    _sample_log(tmp_path / "b.kvlog")
    assert (tmp_path / "a.kvlog").read_bytes() == (tmp_path / "b.kvlog").read_bytes()


@pytest.mark.parametrize("damage,expected", [
    (lambda b: b[:-3], "truncated record"),
    (lambda b: b[:12], "truncated header"),
    (lambda b: b"NOTALOG!" + b[8:], "bad magic"),
    (lambda b: b[:-6] + bytes([b[-6] ^ 0xFF]) + b[-5:], "checksum mismatch"),
])
def test_damaged_logs_name_the_offset(tmp_path, damage, expected):
    _sample_log(tmp_path / "p.kvlog")
    bad = tmp_path / "bad.kvlog"
    bad.write_bytes(damage((tmp_path / "p.kvlog").read_bytes()))
    with pytest.raises(LogError) as caught:
        read_log(str(bad))
    assert expected in str(caught.value)
    assert "at byte" in str(caught.value)


def test_newer_schema_is_refused_clearly(tmp_path):
    path = tmp_path / "new.kvlog"
    writer = LogWriter.open(str(path), LogHeader(schema=99))
    writer.append(ev.Tick(at_ns=1))
    writer.close()
    with pytest.raises(LogError, match="newer than this kvbaton"):
        read_log(str(path))


def test_cli_replay_exit_codes(tmp_path):
    _sample_log(tmp_path / "p.kvlog")
    ok = subprocess.run([sys.executable, "-m", "kvbaton.cli", "replay", "--quiet", str(tmp_path / "p.kvlog")],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip().splitlines()[-1].endswith(", 0 violations")
    bad = tmp_path / "bad.kvlog"
    bad.write_bytes((tmp_path / "p.kvlog").read_bytes()[:-2])
    broken = subprocess.run([sys.executable, "-m", "kvbaton.cli", "replay", str(bad)],
                            capture_output=True, text=True)
    assert broken.returncode == 2
    assert "Traceback" not in broken.stderr and "truncated" in broken.stderr


def test_cli_replay_takes_several_logs_and_folders_and_exits_with_the_worst(tmp_path):
    """`kvbaton replay runs/demo/events/*.kvlog` (or the folder) replays each log in turn."""

    _sample_log(tmp_path / "a.kvlog")
    _sample_log(tmp_path / "b.kvlog")
    cli = [sys.executable, "-m", "kvbaton.cli", "replay", "--quiet"]
    both = subprocess.run(cli + [str(tmp_path / "a.kvlog"), str(tmp_path / "b.kvlog")], capture_output=True, text=True)
    assert both.returncode == 0, both.stderr
    assert both.stdout.count(", 0 violations") == 2 and "2 logs replayed: all clean" in both.stdout
    folder = subprocess.run(cli + [str(tmp_path)], capture_output=True, text=True)
    assert folder.returncode == 0 and "2 logs replayed" in folder.stdout
    (tmp_path / "c.kvlog").write_bytes((tmp_path / "a.kvlog").read_bytes()[:-2])
    worst = subprocess.run(cli + [str(tmp_path)], capture_output=True, text=True)
    assert worst.returncode == 2 and worst.stdout.count(", 0 violations") == 2
    assert "1 could not be read" in worst.stdout and "truncated" in worst.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = subprocess.run(cli + [str(empty)], capture_output=True, text=True)
    assert nothing.returncode == 2 and "no *.kvlog event log" in nothing.stderr


def test_cli_replay_reports_first_violation(tmp_path):
    path = tmp_path / "v.kvlog"
    config = LedgerConfig(block_bytes=1000)
    events = [ev.TicketIssued(at_ns=1, ticket="t", request="r", blocks=(1,))]
    write_log(str(path), events, config, "P0")
    # Corrupt the state on purpose through a ledger that drops the ticket's blocks on the floor.
    from ..property.broken_ledgers import ForgetfulLedger

    events += [ev.ClaimRequested(at_ns=2, ticket="t", claimer="D", epoch=1), ev.Tick(at_ns=10**13)]
    write_log(str(path), events, config, "P0", ledger_factory=ForgetfulLedger, hash_every=0)
    header, records = read_log(str(path))
    result = replay(header, records, ledger_factory=ForgetfulLedger)
    assert result.first_violation.seq == 3
    # The correct ledger does return the blocks, so its state differs from what the broken writer
    # recorded at close: replay names the divergence and exits 1.
    out = subprocess.run([sys.executable, "-m", "kvbaton.cli", "replay", str(path)], capture_output=True, text=True)
    assert out.returncode == 1
    assert "first divergence at record 4" in out.stdout


@pytest.mark.parametrize("name", sorted(p.stem for p in GOLDEN.glob("*.kvlog")))
def test_golden_logs_still_replay(name):
    expected = json.loads((GOLDEN / f"{name}.json").read_text())
    header, records = read_log(str(GOLDEN / f"{name}.kvlog"))
    result = replay(header, records)
    assert result.events == expected["events"]
    assert result.violating_events == 0
    assert result.first_divergence is None
    if header.hash_version == expected["hash_version"] == STATE_HASH_VERSION:
        assert result.state_hash == expected["state_hash"]


def test_a_log_of_an_older_schema_is_refused_with_one_line(tmp_path):
    """Schema 1 logs do not record what P granted: replaying their claims would tell another story
    than the engine lived, so replay says so instead of guessing."""

    enc = msgspec.msgpack.Encoder()
    header = dict(msgspec.to_builtins(LogHeader()), schema=1)
    path = tmp_path / "old.kvlog"
    path.write_bytes(MAGIC + _frame(enc.encode(header)) + _frame(enc.encode([1, ["tk", 5], None])))
    with pytest.raises(LogError, match="log schema 1 is older than this kvbaton reads"):
        read_log(str(path))
    out = _cli_replay(path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "replay it with the kvbaton that wrote it" in out.stderr


def test_golden_logs_cover_grants_refused_and_plain_retention():
    """The simulator's golden pair keeps two paths a demo run rarely takes: D refusing a grant
    for other tokens than its prompt (and giving the ticket back), and P keeping a plain
    request's prompt for history without any claim."""

    def replayed(name):
        header, records = read_log(str(GOLDEN / f"{name}.kvlog"))
        ledger = Ledger(header.config)
        for record in records:
            if record.event is not None:
                ledger.apply(record.event)
        return ledger, [r.event for r in records if r.event is not None]

    d, _ = replayed("v2-sim-D0")
    assert d.counters["loads.grant_refused.grant mismatch"] == 1
    p, events = replayed("v2-sim-P0")
    retained = {e.ticket for e in events if type(e) is ev.RetainRequested}
    assert retained and p.counters["tickets.retained"] == len(retained)
    assert not any(type(e) is ev.ClaimRequested and e.ticket in retained for e in events)
    # The demo's decode log shows what D read where: P's blocks and D's, pairwise.
    header, records = read_log(str(GOLDEN / "v2-D0.kvlog"))
    grants = [r.event for r in records if type(r.event) is ev.ClaimGranted]
    assert grants and all(g.blocks and g.engine and g.digest for g in grants)


def test_writer_flushes_on_close(tmp_path):
    path = tmp_path / "w.kvlog"
    ledger = Ledger()
    writer = LogWriter.open(str(path), LogHeader(hash_every=1))
    for i in range(3):
        event = ev.Tick(at_ns=i)
        ledger.apply(event)
        writer.append(event, ledger)
    writer.close(ledger)
    header, records = read_log(str(path))
    assert [r.seq for r in records] == [1, 2, 3, 4] and records[-1].event is None


def _cli_replay(path, *extra):
    return subprocess.run([sys.executable, "-m", "kvbaton.cli", "replay", str(path), "--quiet", *extra],
                          capture_output=True, text=True)


def test_hostile_logs_get_one_line_and_exit_2(tmp_path):
    enc = msgspec.msgpack.Encoder()
    header = msgspec.to_builtins(LogHeader())
    bad_config = dict(header, config={**header["config"], "unclaimed_ttl_ns": -1})
    cases = {
        "bad-config": MAGIC + _frame(enc.encode(bad_config)) + _frame(enc.encode([1, ["tk", 5], None])),
        "huge-int": MAGIC + _frame(enc.encode(header)) + _frame(enc.encode([1, ["tk", 2**64 - 1], None])),
        "negative-huge": MAGIC + _frame(enc.encode(header)) + _frame(enc.encode(
            [1, ["ti", 1, "t", "r", [2**63]], None])),
    }
    for name, data in cases.items():
        path = tmp_path / f"{name}.kvlog"
        path.write_bytes(data)
        out = _cli_replay(path)
        assert out.returncode == 2, (name, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, (name, out.stderr)
    many = tmp_path / "many.kvlog"
    many.write_bytes(MAGIC + _frame(enc.encode(header)) + b"".join(
        _frame(enc.encode([i, ["tk", i], None])) for i in range(1, 11)))
    out = _cli_replay(many, "--max-records", "5")
    assert out.returncode == 2 and "more than 5 records" in out.stderr
    assert _cli_replay(many).returncode == 0


def test_periodic_checks_still_name_the_first_broken_event():
    class BreaksAt(Ledger):
        def check_invariants(self):
            return super().check_invariants() + (["broken"] if self.now_ns >= 100 else [])

    records = [Record(i, ev.Tick(at_ns=i)) for i in range(1, 301)]
    header = LogHeader()
    coarse = replay(header, records, ledger_factory=BreaksAt, check_every=64)
    assert coarse.first_violation.seq == 128 and coarse.last_clean_seq == 64
    exact = replay(header, records, ledger_factory=BreaksAt, check_every=64, exact_after=coarse.last_clean_seq)
    assert exact.first_violation.seq == 100
    assert replay(header, records, ledger_factory=BreaksAt).first_violation.seq == 100


def test_replay_needs_only_the_core():
    """A core-only install (msgspec, transitions) runs `kvbaton replay`: the command line never
    imports the serving or control-plane packages to build its parser or replay a log."""

    golden = GOLDEN / "v2-P0.kvlog"
    code = ("import sys\n"
            "for name in ('httpx', 'fastapi', 'uvicorn', 'xoscar', 'zmq', 'torch', 'vllm', 'prometheus_client'):\n"
            "    sys.modules[name] = None\n"
            "from kvbaton.cli import main\n"
            f"sys.exit(main(['replay', {str(golden)!r}, '--quiet']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "0 violations" in out.stdout
