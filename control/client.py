"""The connector's side of the control plane: start the sidecar, send facts, drain decisions.

Everything here that runs on vLLM's engine thread is non-blocking: `send` queues on a ZeroMQ PUSH
socket (unbounded), `drain` reads with NOBLOCK. Only `SidecarHandle.start`, called once while the
engine starts, waits (bounded) for the sidecar to come up.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time

import msgspec
import zmq

from . import messages as m
from . import peer as pc
from .config import SidecarConfig, SidecarLaunch, ipc_paths

logger = logging.getLogger("kvbaton.control")


async def close_connections(address: str) -> int:
    """Close this process's cached xoscar connections to `address` (the running loop's), so the
    next call dials afresh and a peer that failed holds no descriptor here; how many closed.
    xoscar keeps them in its router's cache and offers no call for this: a newer xoscar without
    that cache closes nothing (and the connection is dropped when the peer closes it)."""

    try:
        from xoscar.backends.router import Router

        router = Router.get_instance()
        cache = router._cache if router is not None else {}
        keys = [key for key in cache if isinstance(key, tuple) and key and key[0] == address]
    except Exception:  # noqa: BLE001 - an xoscar without this cache: nothing to close
        return 0
    for key in keys:
        client = cache.pop(key, None)
        if client is not None:
            try:
                await client.close()
            except Exception:  # noqa: BLE001 - already closed by the peer
                pass
    return len(keys)


class SidecarError(RuntimeError):
    pass


def private_dir(path: str) -> str:
    """`path` as a directory only this user can enter (created 0700); SidecarError when it exists
    but belongs to another user or others may enter it (it could be a trap: whoever owns it could
    swap the sockets inside)."""

    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise SidecarError(f"kvbaton: {path} exists and is not a directory")
    if info.st_uid != os.getuid():
        raise SidecarError(f"kvbaton: {path} belongs to uid {info.st_uid}, not to this user "
                           f"({os.getuid()}); remove it or set TMPDIR")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, 0o700)  # ours: close it (a umask of 0 or a copy kept it open)
    return path


def ipc_root() -> str:
    """This user's directory for control sockets: the runtime dir when there is one, else a
    per-user directory in the temp dir; 0700 and owned by this user. One another user planted
    in the temp dir is not used (nor is the engine stopped by it): the sockets go under the
    user's home instead."""

    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    base = runtime if runtime and os.path.isdir(runtime) else tempfile.gettempdir()
    try:
        return private_dir(os.path.join(base, f"kvbaton-{os.getuid()}"))
    except SidecarError as exc:
        home = os.path.join(os.path.expanduser("~"), ".kvbaton")
        os.makedirs(home, mode=0o700, exist_ok=True)
        logger.warning("%s; using %s instead", exc, home)
        return private_dir(os.path.join(home, "run"))


def ipc_dir_for(engine_id: str) -> str:
    # Short: AF_UNIX paths are limited to ~107 bytes. Scheduler and workers of one engine find it
    # by the engine id; it lives in this user's private root (see ipc_root).
    safe = "".join(c for c in engine_id if c.isalnum() or c in "-_")[:40]
    return os.path.join(ipc_root(), f"kvb-{safe}")


class Link:
    """A PUSH socket to the sidecar's inbox and a PULL socket for one kind of decision."""

    def __init__(self, ipc_dir: str, listen: str | None, rank: int | None = None) -> None:
        """listen: which decisions to receive ("scheduler", "worker", "history"), or None to only
        send (a second PULL on the same endpoint would get every other message). rank: the worker
        rank this link speaks for (None: the scheduler)."""
        paths = ipc_paths(ipc_dir, 0 if rank is None else rank + 1)
        suffix = "" if rank is None else f".{rank}"
        self.ctx = zmq.Context.instance()
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.SNDHWM, 0)
        self.out.setsockopt(zmq.LINGER, 2000)
        self.out.connect(paths["inbox" + suffix])
        self.inp = None
        if listen is not None:
            self.inp = self.ctx.socket(zmq.PULL)
            self.inp.setsockopt(zmq.LINGER, 0)
            self.inp.connect(paths[listen + suffix])

    def send(self, msg: m.Msg) -> bool:
        """Queue a message; False when it could not be (the caller then gives the handoff up
        rather than leave a request waiting for an answer that will never come)."""

        try:
            self.out.send(m.ENCODER.encode(msg), zmq.NOBLOCK)
            return True
        except Exception as exc:  # never raise into vLLM's engine loop (zmq errors, unencodable)
            logger.warning("kvbaton: could not queue %s for the sidecar: %s", type(msg).__name__, exc)
            return False

    def drain(self) -> list[m.Msg]:
        # The scheduler drains once per engine step, and most steps find nothing. pyzmq lets go
        # of the GIL around every recv, even a non-blocking one that finds nothing, and taking it
        # back waits for whichever thread holds it (vLLM's output thread, our io threads), so the
        # socket is asked first whether anything waits, which keeps the GIL.
        out = []
        while True:
            try:
                if not self.inp.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return out
                raw = self.inp.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            except zmq.ZMQError as exc:
                logger.warning("kvbaton: control socket error: %s", exc)
                return out
            try:
                out.append(m.DECODER.decode(raw))
            except msgspec.DecodeError:
                logger.warning("kvbaton: undecodable control message dropped")

    def wait(self, timeout_s: float) -> list[m.Msg]:
        if self.inp.poll(int(timeout_s * 1000)):
            return self.drain()
        return []

    def close(self) -> None:
        self.out.close(2000)
        if self.inp is not None:
            self.inp.close(0)


class SidecarHandle:
    """The scheduler side's sidecar: a child process it starts, and the link to it."""

    def __init__(self, config: SidecarConfig, process: subprocess.Popen, link: Link, address: str,
                 log_file: str) -> None:
        self.config = config
        self.process = process
        self.link = link
        self.address = address
        self.log_file = log_file
        self.backlog: list[m.Msg] = []
        self.ready = False
        self.instance = ""  # the sidecar's instance epoch, from its Ready
        self.router_address = ""  # where the router's door listens, from its Ready
        # Only the process that started the sidecar stops it: vLLM forks workers from the
        # engine process, and a fork's exit (its inherited atexit hook) must not stop P's sidecar.
        self.creator_pid = os.getpid()
        self._seen_alive_at = float("-inf")  # monotonic time of the last check that found it running

    # The scheduler asks `alive` for every request waiting on the sidecar, every step; the check is
    # a waitpid, which lets go of the GIL (see Link.drain for what taking it back costs). A death
    # is noticed this much later at most: its requests then recompute, as they would anyway.
    ALIVE_RECHECK_S = 0.05

    @classmethod
    def start(cls, config: SidecarConfig, log_dir: str, secret: str) -> "SidecarHandle":
        """Start the sidecar without waiting for it: facts queue in the socket until it binds,
        so engine start is not delayed; its address is known once its Ready says where it
        listens (bound_address). Its configuration and the deployment secret go to it on stdin."""

        if os.path.lexists(config.ipc_dir):
            info = os.lstat(config.ipc_dir)
            if info.st_uid != os.getuid():
                raise SidecarError(f"kvbaton: {config.ipc_dir} belongs to uid {info.st_uid}")
            shutil.rmtree(config.ipc_dir, ignore_errors=True)
        os.mkdir(config.ipc_dir, 0o700)
        link = Link(config.ipc_dir, "scheduler")
        try:
            log_file, fd = open_sidecar_log(log_dir, config.engine_id)
        except OSError as exc:
            raise SidecarError(f"kvbaton: cannot open the sidecar log of engine {config.engine_id} under "
                               f"{log_dir} ({exc.strerror}; a link there is never followed)") from None
        launch = msgspec.json.encode(SidecarLaunch(config=config, secret=secret))
        with os.fdopen(fd, "ab") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "kvbaton.control.sidecar_main"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                preexec_fn=_unpin, env=_sidecar_env(),
            )
        try:
            process.stdin.write(launch)
            process.stdin.close()
        except OSError:  # it died at once: wait_ready / alive report it with its log
            pass
        # No address until the sidecar says where it listens (its Ready): nothing is advertised
        # before the bind is real.
        handle = cls(config, process, link, "", log_file)
        atexit.register(handle.stop)
        return handle

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the sidecar says it is up (tests and tools; the engine never waits)."""

        deadline = time.monotonic() + timeout_s
        while not self.ready and time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            self.backlog.extend(self.link.wait(0.05))
            self._note_ready()
        if not self.ready:
            code = self.process.poll()
            what = f"exited with code {code}" if code is not None else f"is not up after {timeout_s:.0f} s"
            raise SidecarError(f"kvbaton sidecar for engine {self.config.engine_id} {what}; its log "
                               f"{self.log_file} ends:\n{_tail(self.log_file)}")

    def _note_ready(self) -> None:
        kept = []
        for msg in self.backlog:
            if type(msg) is m.Ready:
                self.ready = True
                self.address = msg.address
                self.instance = msg.instance
                self.router_address = msg.router_address
                logger.info("kvbaton: sidecar of engine %s listens at %s", self.config.engine_id, msg.address)
            else:
                kept.append(msg)
        self.backlog = kept

    def send(self, msg: m.Msg) -> bool:
        return self.link.send(msg)

    def bound_address(self, wait_s: float) -> str:
        """Where the sidecar listens, waiting up to `wait_s` for it to say so; "" if it has not
        (messages that arrive meanwhile are kept for the next drain)."""

        if self.ready:
            return self.address
        deadline = time.monotonic() + wait_s
        while not self.ready and self.process.poll() is None:
            self.backlog.extend(self.link.wait(min(0.05, max(0.0, deadline - time.monotonic()))))
            self._note_ready()
            if time.monotonic() >= deadline:
                break
        return self.address if self.ready else ""

    def drain(self) -> list[m.Msg]:
        msgs = self.backlog + self.link.drain() if self.backlog else self.link.drain()
        self.backlog = []
        if not self.ready:
            self.backlog, msgs = msgs, []
            self._note_ready()
            msgs, self.backlog = self.backlog, []
        return msgs

    def alive(self) -> bool:
        now = time.monotonic()
        if now - self._seen_alive_at < self.ALIVE_RECHECK_S:
            return True
        if self.process.poll() is None:
            self._seen_alive_at = now
            return True
        return False

    def stop(self) -> None:
        if os.getpid() != self.creator_pid:
            return
        if self.process.poll() is None:
            try:
                self.link.send(m.Stop())
                self.process.terminate()
                self.process.wait(5)
            except Exception:
                self.process.kill()
        self.link.close()
        shutil.rmtree(self.config.ipc_dir, ignore_errors=True)


SIDECAR_UID = "kvbaton-sidecar"


class CallTimeout(TimeoutError):
    """A call to a sidecar got no answer in time."""


# Packages xoscar loads serializers for, lazily, on the first reply its dispatcher cannot place:
# the first call to a peer then imports torch (800 modules) inside the caller's event loop.
XOSCAR_LAZY_PACKAGES = ("torch", "torch_npu", "cudf", "cupy", "rmm", "mlx")


def keep_xoscar_light() -> None:
    """For our own control-plane processes (sidecars, and `kvbaton serve` / `demo`, which start
    engines as children), which exchange only plain Python values: mark xoscar's lazily loaded
    packages absent before xoscar loads (a `None` entry in `sys.modules` makes `import` fail
    fast), because a first call that imports torch inside an event loop stalls everything that
    loop serves for as long as the import takes on a busy host."""

    import sys

    if "xoscar" in sys.modules:
        # Too late: xoscar may have registered a package's serializers already, and marking it
        # absent now would turn a slow first call into an ImportError inside it.
        logger.debug("keep_xoscar_light: xoscar is loaded already; left as is")
        return
    for name in XOSCAR_LAZY_PACKAGES:
        if name not in sys.modules:
            sys.modules[name] = None


def _retrieve(task) -> None:
    if not task.cancelled():
        task.exception()  # an abandoned call's late failure is not news


async def bounded(awaitable, timeout_s: float, what: str):
    """Await a call for at most `timeout_s`; raise CallTimeout after that.

    On timeout the call is cancelled but not awaited. asyncio.wait_for would wait for the
    cancelled call to finish, and an xoscar call answers its cancellation by asking the peer to
    cancel too and waiting for that answer: a peer that is stopped, wedged, or not an xoscar pool
    at all (another program took its port) never answers, and the caller would hang for good."""

    import asyncio

    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    finally:  # timed out, or the caller itself was cancelled: abandon the call
        if not task.done():
            task.cancel()
            task.add_done_callback(_retrieve)
    if not done:
        raise CallTimeout(f"{what}: no answer within {timeout_s:g} s")
    return task.result()


def open_sidecar_log(log_dir: str, engine_id: str) -> tuple[str, int]:
    """(path, fd) of engine `engine_id`'s sidecar log under `log_dir` (see private_log_dir),
    opened for appending, 0600, never through a link someone planted (OSError then)."""

    path = os.path.join(private_log_dir(log_dir), f"sidecar-{engine_id}.log")
    return path, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)


def private_log_dir(path: str) -> str:
    """Where a sidecar's log goes under `path`: `path` itself, created 0700, when it is missing or
    this user's and closed to others; else (a shared working directory, /tmp) a private
    `kvbaton-<uid>` folder inside it, so nobody else can plant or read the log."""

    if not os.path.isdir(path):
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)
        return path
    info = os.stat(path)
    if info.st_uid == os.getuid() and not stat.S_IMODE(info.st_mode) & 0o022:
        return path
    return private_dir(os.path.join(path, f"kvbaton-{os.getuid()}"))


async def call_peer(address: str, call: pc.PeerCall, timeout_s: float = 10.0, *, to: str = "",
                    sender: str = "router"):
    """Call an engine's sidecar (the router's `Abandon`, `State`) from any asyncio program; the
    answer is decoded as `call`'s typed answer. `to` is the engine's instance epoch (the handoff
    section's `instance`; "" only for `State` and `Residency`). Frames are signed with this
    process's key (installed from the deployment secret if it has none yet). Raises CallTimeout
    when the sidecar does not answer within `timeout_s`."""

    import xoscar as xo

    from .guard import ensure_frame_key

    ensure_frame_key()

    async def call_once():
        ref = await xo.actor_ref(address, SIDECAR_UID)
        return await pc.ask(ref, call, to=to, sender=sender)

    return await bounded(call_once(), timeout_s, f"sidecar {address} ({call.__struct_config__.tag})")


async def call_sidecar(address: str, method: str, *args, timeout_s: float = 10.0, to: str = ""):
    """The state of a sidecar (`method` "debug_state") or an abandon (`"abandon", ticket,
    capability`, addressed `to` the instance that issued the ticket), as plain values: the typed
    calls behind a name, for scripts and tests."""

    if method == "debug_state":
        return (await call_peer(address, pc.State(), timeout_s)).state
    if method == "abandon":
        return (await call_peer(address, pc.Abandon(*args), timeout_s, to=to)).ok
    raise ValueError(f"no peer call named {method!r}")


def call_sidecar_sync(address: str, method: str, *args, timeout_s: float = 10.0, to: str = ""):
    """The same, for scripts and tests without an event loop. Returns within about
    `timeout_s` + 1 s whatever the peer does."""

    import asyncio

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(call_sidecar(address, method, *args, timeout_s=timeout_s, to=to))
    finally:
        # xoscar leaves a listener task per connection (and an abandoned call, after a timeout):
        # cancel them and give them a moment, but never wait on a peer that does not answer.
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=1.0))
        for task in pending:
            if task.done():
                _retrieve(task)
            else:  # still waiting on the peer: dropped with the loop, quietly
                task._log_destroy_pending = False
        loop.close()


def _unpin() -> None:
    """Run in the sidecar before it starts: it must answer peers at once even when the engine
    keeps every core busy (vLLM's engine loop spins while it holds finished requests). So it may
    use any core, not the one the engine pinned, and it gets a higher CPU weight where allowed;
    it is idle almost all the time, so this costs the engine nothing."""

    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError):
        pass
    try:
        os.nice(-10)
    except OSError:  # not permitted (no CAP_SYS_NICE): run at the engine's priority
        pass


def _sidecar_env() -> dict[str, str]:
    env = dict(os.environ)
    # The sidecar runs no kernels: keep OpenMP and BLAS from spinning threads up in it.
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    return env


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except OSError:
        return "(no log)"
