"""A sidecar authority driven directly: its sockets are a list (`authority.sent`: (socket name,
message)) and peer calls are dropped, so tests see exactly what it tells the worker, the
scheduler and the history copier."""

from __future__ import annotations

import msgspec

from kvbaton.control.config import SidecarConfig
from kvbaton.control.sidecar import Authority
from kvbaton.core.ledger import LedgerConfig


LAYOUT = "layout0"
BLOCK_SIZE = 16


def listed_authority(tmp_path, engine_id: str, role: str, ledger: LedgerConfig | None = None,
                     ranks: int = 1) -> Authority:
    cfg = SidecarConfig(engine_id=engine_id, role=role, ledger=ledger or LedgerConfig(), address="127.0.0.1:1",
                        ipc_dir=str(tmp_path / "ipc"), layout=LAYOUT, block_size=BLOCK_SIZE, ranks=ranks)
    authority = Authority(msgspec.json.encode(cfg))
    authority.sent = []
    authority.to_worker, authority.to_scheduler, authority.to_history = "worker", "scheduler", "history"
    authority._send = lambda sock, msg: authority.sent.append((sock, msg))
    # One rank's own message: listed as "worker.1"; with one rank, as any other (see _send_rank).
    authority._send_rank = lambda sock, rank, msg: authority.sent.append(
        (f"{sock}.{rank}" if ranks > 1 else sock, msg))
    authority._spawn = lambda coro: coro.close()  # no peer calls
    return authority
