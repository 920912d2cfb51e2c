"""The deployment secret, capabilities, refusal logs, private directories and a log writer that
refuses what it cannot record without leaving a gap."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from kvbaton.control import guard
from kvbaton.control.client import SidecarError, private_dir
from kvbaton.core import events as ev
from kvbaton.core.log import MAX_RECORD_BYTES, LogHeader, LogRecordError, LogWriter, read_log


@pytest.fixture
def no_secret_env(monkeypatch, tmp_path):
    monkeypatch.delenv(guard.SECRET_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def test_a_routable_control_host_without_a_secret_refuses_and_names_the_settings(no_secret_env):
    for host in ("0.0.0.0", "10.1.2.3", "198.18.0.2", "p-host.example"):
        with pytest.raises(guard.SecretError, match="KVBATON_SECRET or the setting 'secret_file'"):
            guard.resolve_secret("", host)


def test_loopback_engines_share_a_private_per_user_secret(no_secret_env):
    first = guard.resolve_secret("", "127.0.0.1")
    assert guard.resolve_secret("", "localhost") == first == guard.resolve_secret("", "::1")
    path = os.path.expanduser(guard.DEFAULT_SECRET_PATH)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert len(first) >= 32


RANDOM = "3f9c1a7be2d84c06a5f1e93b7d20c4e8"  # 32 hex characters, as `openssl rand -hex 16` gives


def test_the_secret_comes_from_the_environment_first(no_secret_env, monkeypatch):
    monkeypatch.setenv(guard.SECRET_ENV, RANDOM)
    assert guard.resolve_secret("/nonexistent", "10.0.0.1") == RANDOM
    for weak, why in (("short", "at least 32"), ("s" * 40, "distinct characters"),
                      ("abcd" * 10, "distinct characters")):
        monkeypatch.setenv(guard.SECRET_ENV, weak)
        with pytest.raises(guard.SecretError, match=why):
            guard.resolve_secret("", "127.0.0.1")


def test_a_secret_file_must_be_private_and_long_enough(no_secret_env):
    path = no_secret_env / "secret"
    path.write_text(RANDOM + "\n")
    path.chmod(0o644)
    with pytest.raises(guard.SecretError, match="readable by others"):
        guard.resolve_secret(str(path), "10.0.0.1")
    path.chmod(0o600)
    assert guard.resolve_secret(str(path), "10.0.0.1") == RANDOM
    path.write_text("x" * 40)
    with pytest.raises(guard.SecretError, match="distinct characters"):
        guard.resolve_secret(str(path), "10.0.0.1")
    path.write_text("tiny")
    with pytest.raises(guard.SecretError, match="at least 32"):
        guard.resolve_secret(str(path), "10.0.0.1")
    with pytest.raises(guard.SecretError, match="No such file"):
        guard.resolve_secret(str(no_secret_env / "missing"), "10.0.0.1")


def test_frame_keys_and_capability_digests_never_equal_their_inputs():
    secret = "k" * 40
    assert guard.frame_key(secret) != secret and len(guard.frame_key(secret)) == 64
    cap = guard.mint_capability()
    assert len(cap) == 32 and guard.capability_digest(cap) != cap
    assert guard.mint_capability() != cap


def test_refusal_log_is_rate_limited_per_reason(caplog):
    log = guard.RateLimitedLog(logging.getLogger("kvbaton.test.refusals"), burst=3, window_s=60.0)
    with caplog.at_level(logging.WARNING, logger="kvbaton.test.refusals"):
        for i in range(50):
            log.warning("invalid", "refused %d", i)
        log.warning("method", "other reason")
    assert len(caplog.records) == 4


def test_a_private_dir_owned_by_someone_else_is_refused(tmp_path):
    mine = private_dir(str(tmp_path / "mine"))
    assert stat.S_IMODE(os.stat(mine).st_mode) == 0o700
    other = tmp_path / "planted"
    other.mkdir(mode=0o777)
    os.chown(other, 12345, 12345)  # the tests run as root: plant a directory of another user
    with pytest.raises(SidecarError, match="belongs to uid 12345"):
        private_dir(str(other))


def test_sidecar_logs_in_a_shared_folder_go_to_a_private_one_and_never_through_a_link(tmp_path):
    from kvbaton.control.client import open_sidecar_log, private_log_dir

    mine = tmp_path / "mine"
    assert private_log_dir(str(mine)) == str(mine) and stat.S_IMODE(os.stat(mine).st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp, or a working directory others may write
    inside = private_log_dir(str(shared))
    assert inside == str(shared / f"kvbaton-{os.getuid()}") and stat.S_IMODE(os.stat(inside).st_mode) == 0o700
    path, fd = open_sidecar_log(str(shared), "E0")
    os.close(fd)
    assert path == os.path.join(inside, "sidecar-E0.log") and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    planted = tmp_path / "target"
    (mine / "sidecar-E1.log").symlink_to(planted)
    with pytest.raises(OSError):
        open_sidecar_log(str(mine), "E1")
    assert not planted.exists()


def test_the_log_writer_refuses_what_it_cannot_record_without_a_gap(tmp_path):
    path = tmp_path / "x.kvlog"
    writer = LogWriter.open(str(path), LogHeader())
    writer.append(ev.Tick(1))
    with pytest.raises(LogRecordError, match="cannot be encoded"):
        writer.append(ev.ClaimRequested(2, "t", "D", 2**70))
    with pytest.raises(LogRecordError, match="record bound"):
        writer.append(ev.AbandonRequested(3, "x" * (MAX_RECORD_BYTES + 1)))
    writer.append(ev.Tick(4))
    writer.close()
    _, records = read_log(str(path))
    assert [r.seq for r in records] == [1, 2]
