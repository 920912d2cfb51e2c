"""The sidecar process: `python -m kvbaton.control.sidecar_main`, its launch (configuration and
secret) as JSON on stdin, never on the command line (`ps` shows argv to every local user).

It hosts an xoscar actor pool with one actor, `SidecarActor`, which holds the engine's `Sidecar`
(sidecar.py) with the process's IO (io.py) and is the only door peers have: one method, `call`,
one authenticated frame in. Frames are authenticated before the pool exists (guard.py), so
nothing is ever decoded without the key.

xoscar loads serializers for torch, cupy... lazily, on the first message its dispatcher cannot
place, which is the first call to a peer: seconds of imports in front of the first claim, and far
longer when the engines next door keep every core busy. The sidecar only exchanges plain Python
values, so it marks those packages absent before xoscar loads (`control.client.keep_xoscar_light`).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import sys

logger = logging.getLogger("kvbaton.sidecar")

# Connections and messages the pool refused before the sidecar saw them (frames without our key,
# pool messages other than the sidecar's calls), by reason; shown with its own refusals.
FRAME_REFUSALS: collections.Counter = collections.Counter()


def open_event_log(cfg):
    """The engine's event log, readable by its owner only (0600 in a 0700 directory, whatever the
    umask): a log holds ticket ids, which are bearer capabilities while their tickets are open."""

    from ..core.log import LogHeader, LogWriter

    folder = os.path.dirname(cfg.log_path) or "."
    if not os.path.isdir(folder):
        os.makedirs(folder, mode=0o700, exist_ok=True)
    elif os.stat(folder).st_mode & 0o077:
        logger.warning("event log directory %s is open to other users; its logs are 0600, "
                       "but a 0700 directory keeps their names private too", folder)
    fd = os.open(cfg.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    return LogWriter(os.fdopen(fd, "wb"), LogHeader(
        engine=cfg.engine_id, role=cfg.role, config=cfg.ledger, hash_every=cfg.hash_every,
        writer="kvbaton sidecar"))


def _actor_class():
    import msgspec
    import xoscar as xo

    from . import peer as pc
    from .config import SidecarConfig
    from .io import ProcessIo
    from .sidecar import Sidecar

    class SidecarActor(xo.Actor):
        """The sidecar as peers reach it: `call` is its only method they may use."""

        def __init__(self, config_json: bytes, address: str = "", router_key: bytes = b"") -> None:
            super().__init__()
            cfg = msgspec.json.decode(config_json, type=SidecarConfig)
            self.io = ProcessIo(cfg)
            self.sidecar = Sidecar(cfg, self.io, address=address, router_key=router_key,
                                   log=open_event_log(cfg) if cfg.log_path else None)
            self.sidecar.frame_refusals = FRAME_REFUSALS

        async def __post_create__(self) -> None:
            sidecar = self.sidecar
            advertised = sidecar.address.rpartition(":")[0].strip("[]")
            await self.io.start(sidecar.on_message, sidecar.metrics_snapshot, sidecar.close,
                                sidecar.server.answer_router, advertised)
            sidecar.router_address = self.io.router_address
            sidecar.start()

        async def __pre_destroy__(self) -> None:
            await self.io.close()

        async def __on_receive__(self, message):
            """The only door peers have: the `call` method, one bytes argument, no keywords.
            Every other method (private ones, `__post_create__`, the shell's own) is refused."""

            from xoscar.core import CALL_METHOD_DEFAULT

            try:
                method, call_method, args, kwargs = message
            except (TypeError, ValueError):
                self.sidecar.server.refuse("method", "malformed actor message")
                raise PermissionError("not a kvbaton peer call") from None
            if method != pc.PEER_METHOD or call_method != CALL_METHOD_DEFAULT or len(args) != 1 or kwargs:
                self.sidecar.server.refuse("method", f"method {str(method)[:64]!r}")
                raise PermissionError("kvbaton sidecars answer only their protocol's calls")
            return await super().__on_receive__(message)

        async def call(self, payload) -> bytes:
            return self.sidecar.server.answer_frame(payload)

    return SidecarActor


async def _create_pool(cfg):
    import xoscar as xo

    try:
        return await xo.create_actor_pool(cfg.address, n_process=0)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise SystemExit(f"kvbaton sidecar: control address {cfg.address} is already in use "
                             f"(control_port: another program, or another engine, holds it)") from None
        raise


async def _main(launch) -> None:
    import signal

    import msgspec
    import xoscar as xo

    from .client import SIDECAR_UID
    from .router_door import router_key
    from .guard import RateLimitedLog, Strangers, bound_strangers, guard_pool, install_frame_key, watch_refused_frames

    cfg = launch.config
    # Frames are authenticated before the pool exists: nothing is ever decoded without the key.
    install_frame_key(launch.secret)
    frame_log = RateLimitedLog(logger)

    def frame_refused(reason: str, text: str) -> None:
        FRAME_REFUSALS[reason] += 1
        frame_log.warning(reason, "dropped a connection: %s", text)

    watch_refused_frames(frame_refused)
    pool = await _create_pool(cfg)
    guard_pool(pool, SIDECAR_UID, lambda reason, peer: frame_refused(reason, f"{reason} from {peer}"))
    # Connections without the key cannot pile up: capped, and closed unless they authenticate soon.
    bound_strangers(pool, Strangers(cfg.strangers_max, cfg.strangers_per_source, cfg.first_frame_s),
                    lambda reason, peer: frame_refused(reason, f"{reason} from {peer}"))
    await xo.create_actor(_actor_class(), msgspec.json.encode(cfg), pool.external_address,
                          router_key(launch.secret), address=pool.external_address, uid=SIDECAR_UID)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await pool.stop()  # destroys the actor: its IO closes the log with a checkpoint


def main() -> None:
    from .client import keep_xoscar_light

    keep_xoscar_light()  # before anything imports xoscar
    import msgspec

    from .config import SidecarLaunch

    logging.basicConfig(level=os.environ.get("KVBATON_SIDECAR_LOG", "WARNING"),
                        format="%(asctime)s kvbaton-sidecar %(levelname)s %(message)s")
    launch = msgspec.json.decode(sys.stdin.buffer.read(), type=SidecarLaunch)
    asyncio.run(_main(launch))


if __name__ == "__main__":
    main()
