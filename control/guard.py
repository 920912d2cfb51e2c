"""Who may talk to a sidecar: the deployment secret, authenticated frames, and the pool's gate.

* **The secret.** `KVBATON_SECRET`, else the setting `secret_file` (a file readable by its owner
  only), else, for engines whose control address is loopback, a per-user secret file created
  0600 on first use (`~/.kvbaton/secret`), so engines of one user on one host are authenticated
  with no configuration. A routable control address without an explicit secret refuses to start.
* **Authenticated frames.** xoscar signs every frame with HMAC-SHA256 under `XOSCAR_AUTH_KEY` and
  verifies the whole frame before it unpickles anything; a frame without the key, or signed with
  another, is dropped with its connection. `install_frame_key` derives that key from the secret
  (so the secret itself never sits in a process environment), `watch_refused_frames` counts the
  drops (xoscar reports them only to its debug log).
* **The pool's gate.** Even an authenticated peer may only look the sidecar up and call it:
  `guard_pool` refuses every other pool message (create or destroy actors, stop the pool, ...)
  from anything but the sidecar's own process, and records the peer's address for the refusal
  log of the sidecar's `call`.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import hashlib
import ipaddress
import logging
import os
import secrets
import stat
import time

logger = logging.getLogger("kvbaton.guard")

SECRET_ENV = "KVBATON_SECRET"
FRAME_KEY_ENV = "XOSCAR_AUTH_KEY"
MIN_SECRET_CHARS = 32
# A secret of so few distinct characters is a pattern (a repeated word, a padded name), not the
# output of a random generator: 32 random hex characters use about 14 of their 16.
MIN_SECRET_DISTINCT = 10
DEFAULT_SECRET_PATH = os.path.join("~", ".kvbaton", "secret")

# The address of the peer whose call the sidecar is answering (set by guard_pool).
peer_address: contextvars.ContextVar[str] = contextvars.ContextVar("kvbaton_peer", default="?")


class SecretError(ValueError):
    """No usable deployment secret; the message names the setting to change."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _read_private(path: str) -> str:
    # Symlinks are followed (Kubernetes and Docker mount secrets through them); what counts is
    # the file they lead to: owned by this user or root, and unreadable by anyone else.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise SecretError(f"secret file {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if info.st_uid not in (os.getuid(), 0):
            raise SecretError(f"secret file {path} belongs to uid {info.st_uid}, not to this user "
                              f"({os.getuid()}) or root")
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretError(f"secret file {path} is readable by others (mode "
                              f"{stat.S_IMODE(info.st_mode):o}); chmod 600 it")
        secret = os.read(fd, 4096).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)
    check_secret(secret, f"secret file {path}")
    return secret


def check_secret(secret: str, where: str) -> None:
    """SecretError unless `secret` is long and varied enough to be a random one."""

    if len(secret) < MIN_SECRET_CHARS:
        raise SecretError(f"{where} holds {len(secret)} characters; at least {MIN_SECRET_CHARS} random "
                          f"characters are needed (e.g. `openssl rand -hex 32`)")
    if len(set(secret)) < MIN_SECRET_DISTINCT:
        raise SecretError(f"{where} uses only {len(set(secret))} distinct characters: it is a pattern, not a "
                          f"random secret (make one with `openssl rand -hex 32`)")


def default_secret(path: str | None = None) -> str:
    """This user's secret on this host, created 0600 (in a 0700 directory) on first use."""

    path = os.path.expanduser(path or DEFAULT_SECRET_PATH)
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        return _default_secret_in(folder, path)
    except OSError as exc:
        raise SecretError(f"cannot keep the per-user secret at {path} ({exc.strerror}): set "
                          f"{SECRET_ENV} or the setting 'secret_file'") from None


def _default_secret_in(folder: str, path: str) -> str:
    info = os.stat(folder)
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise SecretError(f"secret folder {folder} belongs to another user or is writable by others")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass  # another engine made it first (or earlier): use theirs
    else:
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32) + "\n")
    for _ in range(50):  # a racing creator may not have written it yet
        try:
            return _read_private(path)
        except SecretError:
            if os.path.getsize(path) >= MIN_SECRET_CHARS:
                raise
            time.sleep(0.01)
    return _read_private(path)


def resolve_secret(secret_file: str = "", control_host: str = "127.0.0.1") -> str:
    """The deployment secret, by precedence; SecretError names what to set."""

    secret = os.environ.get(SECRET_ENV, "")
    if secret:
        check_secret(secret, SECRET_ENV)
        return secret
    if secret_file:
        return _read_private(os.path.expanduser(secret_file))
    if not is_loopback(control_host):
        raise SecretError(f"control_host {control_host!r} is reachable from other hosts, and no "
                          f"deployment secret is set: set {SECRET_ENV} or the setting 'secret_file' "
                          f"(the same secret on every engine and on the router)")
    return default_secret()


def frame_key(secret: str) -> str:
    return hashlib.blake2b(secret.encode(), key=b"kvbaton-frames-v1", digest_size=32).hexdigest()


# The largest frame manifest read before its MAC is checked. xoscar allows 16 MiB, which lets
# anyone who reaches the port make a process buffer 16 MiB per connection without the key; a
# manifest is 16 bytes plus 9 per buffer, and kvbaton's frames carry a handful of buffers.
MAX_UNAUTHENTICATED_MANIFEST = 64 << 10


def install_frame_key(secret: str) -> None:
    """Turn on xoscar's frame authentication for this process, under the secret's key."""

    os.environ[FRAME_KEY_ENV] = frame_key(secret)
    try:
        from xoscar.serialization import _security, aio
    except ImportError:  # a router-only install: no sidecar calls
        return
    aio.MAX_MANIFEST_SIZE = _security.MAX_MANIFEST_SIZE = MAX_UNAUTHENTICATED_MANIFEST


def ensure_frame_key(secret_file: str = "") -> None:
    """For tools and the router: authenticate this process's frames under the deployment secret
    (KVBATON_SECRET, `secret_file`, else this user's per-host secret) unless a key is set."""

    if not os.environ.get(FRAME_KEY_ENV):
        install_frame_key(resolve_secret(secret_file, "127.0.0.1"))


def capability_digest(capability: str) -> str:
    """What P keeps (and logs) of a capability it minted: never the capability itself."""

    return hashlib.blake2b(capability.encode(), key=b"kvbaton-capability-v1", digest_size=16).hexdigest()


def mint_capability() -> str:
    return secrets.token_hex(16)


class RateLimitedLog:
    """At most `burst` lines per `window_s` per reason; the rest are summed into the next line."""

    def __init__(self, log: logging.Logger, burst: int = 5, window_s: float = 10.0) -> None:
        self.log, self.burst, self.window_s = log, burst, window_s
        self._windows: dict[str, list] = {}

    def warning(self, reason: str, message: str, *args) -> None:
        now = time.monotonic()
        window = self._windows.get(reason)
        if window is None or now - window[0] > self.window_s:
            suppressed = window[2] if window else 0
            window = self._windows[reason] = [now, 0, 0]
            if suppressed:
                message += f" ({suppressed} more like it suppressed)"
        window[1] += 1
        if window[1] > self.burst:
            window[2] += 1
            return
        self.log.warning(message, *args)


# xoscar's words for a frame it dropped because it was not signed with our key.
_UNAUTHENTICATED_MARKS = ("unauthenticated frame", "authentication failed",
                          "authenticated frame but XOSCAR_AUTH_KEY")
_MALFORMED_MARKS = ("malformed", "truncated frame")


class _RefusedFrames(logging.Filter):
    def __init__(self, on_refused) -> None:
        super().__init__()
        self.on_refused = on_refused

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno <= logging.DEBUG:
            text = record.getMessage()
            if "close connection due to" in text:
                if any(mark in text for mark in _UNAUTHENTICATED_MARKS):
                    self.on_refused("unauthenticated", text)
                elif any(mark in text for mark in _MALFORMED_MARKS):
                    self.on_refused("malformed_frame", text)
            return False  # xoscar's debug lines stay out of the sidecar's log
        return True


def watch_refused_frames(on_refused) -> None:
    """Call `on_refused(reason, text)` for each connection xoscar drops for a bad frame."""

    pool_logger = logging.getLogger("xoscar.backends.pool")
    pool_logger.setLevel(logging.DEBUG)
    pool_logger.addFilter(_RefusedFrames(on_refused))


def _peer_of(channel) -> str:
    """The remote end of a server-side channel (xoscar leaves dest_address empty there)."""

    writer = getattr(channel, "writer", None)
    try:
        peer = writer.get_extra_info("peername") if writer is not None else None
    except Exception:  # noqa: BLE001 - a closed transport: no address to report
        peer = None
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer or getattr(channel, "dest_address", None) or "?")


def guard_pool(pool, sidecar_uid: str, on_refused) -> None:
    """Let remote channels only look up and call the sidecar; everything else from them is
    refused with an error answer (`on_refused(reason, peer)`). In-process messages (the sidecar
    creating its own actor, stopping its own pool) pass."""

    from xoscar.backends.communication.dummy import DummyChannel
    from xoscar.backends.message import MessageType

    allowed = {MessageType.actor_ref, MessageType.has_actor, MessageType.send, MessageType.cancel}
    uid = sidecar_uid.encode()
    original = pool.process_message

    def _uid_of(message) -> bytes | None:
        ref = getattr(message, "actor_ref", None)
        value = getattr(ref, "uid", None)
        return value.encode() if isinstance(value, str) else value

    async def process_message(message, channel):
        if isinstance(channel, DummyChannel):
            return await original(message, channel)
        address = _peer_of(channel)
        kind = getattr(message, "message_type", None)
        if kind not in allowed or (kind in (MessageType.send, MessageType.actor_ref,
                                            MessageType.has_actor) and _uid_of(message) != uid):
            on_refused("pool_message", address)
            from xoscar.backends.pool import _ErrorProcessor

            with _ErrorProcessor(pool.external_address, message.message_id, message.protocol) as err:
                raise PermissionError("kvbaton sidecars answer only their protocol's calls")
            await pool._send_channel(err.result, channel)
            return
        peer_address.set(address)
        return await original(message, channel)

    pool.process_message = process_message


class Strangers:
    """Connections to the control port that have not yet sent a frame with the deployment key.

    A connection counts as a stranger from accept until its first frame is read whole (xoscar
    checks the frame's HMAC before anything in it is decoded, and drops the connection when it
    fails). Strangers are capped per source host and in total, and each has `first_frame_s` to
    send that frame; past a cap the connection is closed at once, past the deadline it is closed,
    and both are refused by reason (`stranger_cap`, `first_frame_deadline`). A peer with the key
    authenticates within its first round trip, so legitimate connections are strangers for
    milliseconds: the caps bound what a host without the key can hold (descriptors, memory), not
    how many peers a deployment has."""

    def __init__(self, total: int, per_source: int, first_frame_s: float) -> None:
        self.total, self.per_source, self.first_frame_s = total, per_source, first_frame_s
        self.held = 0
        self.by_source: collections.Counter = collections.Counter()

    def admit(self, source: str) -> bool:
        if self.held >= self.total or self.by_source[source] >= self.per_source:
            return False
        self.held += 1
        self.by_source[source] += 1
        return True

    def release(self, source: str) -> None:
        self.held -= 1
        self.by_source[source] -= 1
        if self.by_source[source] <= 0:
            del self.by_source[source]


def bound_strangers(pool, strangers: Strangers, on_refused) -> None:
    """Serve the pool's remote connections under `strangers`' caps and first-frame deadline
    (`on_refused(reason, peer)` for each connection closed for them). In-process channels pass."""

    from xoscar.backends.communication.dummy import DummyChannel

    original = pool.on_new_channel

    async def on_new_channel(channel):
        if isinstance(channel, DummyChannel):
            return await original(channel)
        address = _peer_of(channel)
        source = address.rpartition(":")[0] or address
        if not strangers.admit(source):
            on_refused("stranger_cap", address)
            await _close_quietly(channel)
            return
        stranger = True
        try:
            while not pool._stopped.is_set():
                try:
                    if stranger:
                        message = await asyncio.wait_for(channel.recv(), strangers.first_frame_s)
                        stranger = False
                        strangers.release(source)
                    else:
                        message = await channel.recv()
                except asyncio.TimeoutError:
                    on_refused("first_frame_deadline", address)
                    return
                except (EOFError, ConnectionError, BrokenPipeError) as exc:
                    # Said as xoscar's own loop says it: watch_refused_frames counts a frame
                    # dropped for want of our key from this line.
                    logging.getLogger("xoscar.backends.pool").debug("pool: close connection due to %s", exc)
                    return
                # What xoscar's own loop does with a frame (pool.on_new_channel).
                if await pool._handle_buffer_meta_message(message, channel):
                    continue
                asyncio.create_task(pool.process_message(message, channel))
                del message
                await asyncio.sleep(0)
        finally:
            if stranger:
                strangers.release(source)
            await _close_quietly(channel)

    pool.on_new_channel = on_new_channel


async def _close_quietly(channel) -> None:
    try:
        await channel.close()
    except Exception:  # noqa: BLE001 - already closed by the other end: nothing to release
        pass
