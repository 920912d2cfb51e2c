"""The sidecar's IO seam: everything the sidecar does to the world goes through one object.

`Sidecar` (sidecar.py) decides; its IO carries. An IO gives the clock events are stamped with,
sleeps and background tasks, the messages to the engine's connector (the scheduler, every worker
rank, every rank's history copier) and connections to peers' sidecars. Three implement it:
`ProcessIo` here (ZeroMQ sockets to the connector, xoscar to peers, the OS clock), the shell
simulator's `SimIo` (sim/shell.py: a virtual clock and network, seeded faults) and the tests'
`ListIo` (testing/fake_io.py: messages kept in a list, peer calls never made). The sidecar never
reaches a socket, a clock or the network any other way, so the simulator and the tests run the
production sidecar unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from typing import Protocol

from . import messages as m
from .config import SidecarConfig, ipc_paths

logger = logging.getLogger("kvbaton.sidecar")

# Where decisions go: the scheduler, every worker rank, every rank's history copier.
SCHEDULER, WORKER, HISTORY = "scheduler", "worker", "history"


class PeerRef(Protocol):
    """A connection to a peer's sidecar: one call, an authenticated frame in, bytes out."""

    async def call(self, payload: bytes) -> bytes: ...


class SidecarIo(Protocol):
    def now_ns(self) -> int:
        """The monotonic clock every event is stamped with."""

    def wall_ns(self) -> int:
        """Wall-clock nanoseconds: a peer call's freshness and this instance's start stamp."""

    async def sleep(self, seconds: float) -> None: ...

    def spawn(self, coro) -> None:
        """Run `coro` in the background until it ends or the sidecar stops."""

    def send(self, dest: str, msg: m.Msg, rank: int | None = None) -> None:
        """Queue `msg` for the connector's `dest`: every rank's, or worker rank `rank`'s only.
        Messages to one destination arrive in the order they were sent."""

    async def connect(self, address: str) -> PeerRef:
        """A connection to the sidecar at `address` (raises when nobody answers there)."""

    async def disconnect(self, address: str) -> None:
        """Drop any connection to `address`, so the next call dials afresh."""

    async def exit(self) -> None:
        """The engine told its sidecar to stop: end the process."""


class ProcessIo:
    """The production IO: the sidecar process's clock, its ZeroMQ sockets to the engine's
    connector, xoscar connections to peers, and the watch on the engine process that started it."""

    def __init__(self, cfg: SidecarConfig) -> None:
        self.cfg = cfg
        self.tasks: set[asyncio.Task] = set()
        self.outboxes: dict[str, list[asyncio.Queue]] = {}
        self.sockets: list = []
        self.zctx = None
        self.metrics_server = None
        self.router_server = None
        self.router_address = ""
        self.on_close = lambda: None
        self.closed = False

    # -- the seam ----------------------------------------------------------------------------------

    def now_ns(self) -> int:
        return time.monotonic_ns()

    def wall_ns(self) -> int:
        return time.time_ns()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def send(self, dest: str, msg: m.Msg, rank: int | None = None) -> None:
        # One sender per socket keeps each destination's order and waits (without blocking the
        # sidecar) until the connector side has connected.
        payload = m.ENCODER.encode(msg)
        queues = self.outboxes[dest]
        if rank is None or len(queues) == 1:
            for queue in queues:
                queue.put_nowait(payload)
        else:
            queues[rank].put_nowait(payload)

    async def connect(self, address: str):
        import xoscar as xo

        from .client import SIDECAR_UID

        return await xo.actor_ref(address, SIDECAR_UID)

    async def disconnect(self, address: str) -> None:
        from .client import close_connections

        await close_connections(address)

    async def exit(self) -> None:
        """Only the engine stops its sidecar (over its 0700 IPC directory, never a peer), and a
        stopped sidecar does not linger as a process that answers peers but returns nothing: the
        pool is told to stop, which ends the process."""

        import signal

        await self.close()
        os.kill(os.getpid(), signal.SIGTERM)

    # -- the process -------------------------------------------------------------------------------

    async def start(self, on_message, metrics_snapshot, on_close, answer_router=None, advertised_host: str = "") -> None:
        """Bind the connector's sockets (facts to `on_message(msg, rank)`), serve metrics and the
        router's door (`answer_router(body, mac)`, advertised on `advertised_host`), and watch the
        engine that started this process; `on_close()` runs first when this IO closes (the
        sidecar closes its event log)."""

        import zmq
        import zmq.asyncio

        cfg = self.cfg
        self.on_close = on_close
        self.zctx = zmq.asyncio.Context()
        paths = ipc_paths(cfg.ipc_dir, cfg.ranks)
        # The scheduler's inbox, then one per worker rank: a fact's rank is the socket it came on.
        for rank, name in [(0, "inbox")] + [(r, f"inbox.{r}") for r in range(cfg.ranks)]:
            inbox = self.zctx.socket(zmq.PULL)
            inbox.bind(paths[name])
            self.sockets.append(inbox)
            self.spawn(self._inbox_loop(inbox, rank, on_message))
        for dest, names in ((SCHEDULER, ["scheduler"]), (WORKER, [f"worker.{r}" for r in range(cfg.ranks)]),
                            (HISTORY, [f"history.{r}" for r in range(cfg.ranks)])):
            self.outboxes[dest] = []
            for name in names:
                sock = self.zctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.setsockopt(zmq.LINGER, 0)
                sock.bind(paths[name])
                self.sockets.append(sock)
                queue: asyncio.Queue = asyncio.Queue()
                self.outboxes[dest].append(queue)
                self.spawn(self._sender_loop(sock, queue))
        if cfg.parent_pid:
            self.spawn(self._watch_engine())
        await self._serve_metrics(metrics_snapshot)
        if answer_router is not None:
            await self._serve_router_door(answer_router, advertised_host)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.on_close()
        for task in list(self.tasks):
            task.cancel()
        for server in (self.metrics_server, self.router_server):
            if server is not None:
                server.close()
        for sock in self.sockets:
            sock.close(0)
        shutil.rmtree(self.cfg.ipc_dir, ignore_errors=True)

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("sidecar task failed: %r", task.exception())

    async def _inbox_loop(self, inbox, rank: int, on_message) -> None:
        while True:
            raw = await inbox.recv()
            try:
                msg = m.DECODER.decode(raw)
                on_message(msg, rank)
            except Exception:  # a bad message must not take the sidecar down
                logger.exception("could not handle a connector message")

    async def _sender_loop(self, sock, queue: asyncio.Queue) -> None:
        while True:
            payload = await queue.get()
            await sock.send(payload)

    async def _watch_engine(self) -> None:
        # The engine started us: once it is gone we are re-parented (a dead but unreaped engine
        # still answers kill(pid, 0), so the parent id is the reliable sign).
        parent = self.cfg.parent_pid
        while True:
            await asyncio.sleep(self.cfg.tick_interval_s)
            if os.getppid() != parent or not _alive(parent):
                logger.warning("engine process %d is gone: stopping", parent)
                await self.close()
                os._exit(0)

    async def _serve_router_door(self, answer_router, advertised_host: str) -> None:
        """The router's door (router_door.py), on the control address's host at `router_port`
        (0: the kernel chooses). One that cannot be bound is logged: the router then cannot
        abandon tickets early (they expire) or read counts, and handoffs go on."""

        from . import router_door

        host = self.cfg.address.rpartition(":")[0].strip("[]") or "127.0.0.1"
        try:
            self.router_server = await router_door.serve(host, self.cfg.router_port, answer_router)
        except OSError as exc:
            logger.error("kvbaton sidecar of engine %s: cannot serve the router's door on %s:%d (router_port): "
                         "%s; handoffs go on, the router cannot abandon tickets early", self.cfg.engine_id,
                         host, self.cfg.router_port, exc)
            return
        port = self.router_server.sockets[0].getsockname()[1]
        shown = advertised_host or host
        self.router_address = f"[{shown}]:{port}" if ":" in shown else f"{shown}:{port}"

    async def _serve_metrics(self, snapshot) -> None:
        """The Prometheus endpoint (`metrics_port`), on the host the control address binds. A
        port that cannot be bound is logged and the sidecar serves handoffs without it: metrics
        must never cost the engine its handoffs."""

        port = self.cfg.metrics_port
        if not port:
            return
        host = self.cfg.address.rpartition(":")[0].strip("[]") or "127.0.0.1"
        try:
            from . import metrics

            self.metrics_server = await metrics.serve(host, port, snapshot)
        except Exception as exc:
            logger.error("kvbaton sidecar of engine %s: cannot serve metrics on %s:%d (metrics_port): %s; "
                         "handoffs go on without metrics", self.cfg.engine_id, host, port, exc)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
