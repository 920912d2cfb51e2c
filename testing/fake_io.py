"""A sidecar driven by a test: `ListIo` keeps what the sidecar tells the engine in a list and makes
no peer call unless the test runs it.

    sidecar = listed_sidecar(tmp_path, "D0", "consumer")
    sidecar.on_message(m.Apply((ev.LoadRequested(...),)))
    assert sidecar.io.sent == [("scheduler", m.Resolved(...))]

`io.sent` holds (destination, message) pairs: "scheduler", "worker" or "history" for every rank's,
"worker.R" for one rank's when the engine has several. The coroutines the sidecar starts (peer
calls, timers) are dropped unless `io.keep_spawned` is set: then `io.spawned` holds them, unstarted,
and a test that wants a call made awaits it itself (`run_spawned`).
`io.clock_ns` is the clock; a test moves it.
"""

from __future__ import annotations

from ..control import messages as m
from ..control import peer as pc
from ..control.config import SidecarConfig
from ..control.sidecar import Sidecar
from ..core.ledger import LedgerConfig

LAYOUT = "layout0"
BLOCK_SIZE = 16


class ListIo:
    def __init__(self, ranks: int = 1, clock_ns: int = 1_000_000_000) -> None:
        self.ranks = ranks
        self.clock_ns = clock_ns
        self.sent: list[tuple[str, m.Msg]] = []
        self.keep_spawned = False
        self.spawned: list = []
        self.peers: dict[str, object] = {}  # address -> a ref a test put there (`connect`)
        self.disconnected: list[str] = []

    def now_ns(self) -> int:
        return self.clock_ns

    def wall_ns(self) -> int:
        import time

        return time.time_ns()

    async def sleep(self, seconds: float) -> None:
        self.clock_ns += int(seconds * 1e9)

    def spawn(self, coro) -> None:
        if self.keep_spawned:
            self.spawned.append(coro)
        else:
            coro.close()

    def send(self, dest: str, msg: m.Msg, rank: int | None = None) -> None:
        self.sent.append((f"{dest}.{rank}" if rank is not None and self.ranks > 1 else dest, msg))

    async def connect(self, address: str):
        ref = self.peers.get(address)
        if ref is None:
            raise ConnectionRefusedError(f"nobody listens at {address}")
        return ref

    async def disconnect(self, address: str) -> None:
        self.disconnected.append(address)

    async def exit(self) -> None:
        pass


class ScriptedPeer:
    """A peer's sidecar as a test scripts it: each call decoded, recorded (`calls`) and answered
    with `answer(call)`. Put it in `ListIo.peers` under its address."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.calls: list = []

    async def call(self, payload: bytes) -> bytes:
        call = pc.decode_call(payload).call
        self.calls.append(call)
        return pc.ENCODER.encode(self.answer(call))


async def run_spawned(io: ListIo, coro=None) -> None:
    """Await `coro`, then every coroutine the sidecar started meanwhile (in order), until none is left."""

    if coro is not None:
        await coro
    while io.spawned:
        await io.spawned.pop(0)


def listed_sidecar(tmp_path, engine_id: str, role: str, ledger: LedgerConfig | None = None,
                   ranks: int = 1, **config) -> Sidecar:
    """A strict sidecar with a `ListIo` (`sidecar.io`)."""

    cfg = SidecarConfig(engine_id=engine_id, role=role, ledger=ledger or LedgerConfig(), address="127.0.0.1:1",
                        ipc_dir=str(tmp_path / "ipc"), layout=LAYOUT, block_size=BLOCK_SIZE, ranks=ranks, **config)
    return Sidecar(cfg, ListIo(ranks), strict=True)
