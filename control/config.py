"""The sidecar's configuration and socket paths (light: imported inside vLLM's engine process)."""

from __future__ import annotations

import msgspec

from ..core.ledger import LedgerConfig
from .hooks import SidecarHooks


class SidecarConfig(msgspec.Struct, kw_only=True):
    engine_id: str
    role: str  # "producer", "consumer" or "both"
    ledger: LedgerConfig
    # host:port the xoscar pool binds: port 0 lets the kernel choose (the sidecar says in its
    # Ready where it listens); an operator's port is bound as given, or the sidecar exits.
    address: str
    ipc_dir: str
    log_path: str = ""
    hash_every: int = 10000  # the connector passes EVENT_LOG_HASH_EVERY
    heartbeat_interval_s: float = 10.0
    call_timeout_s: float = 10.0  # a call to a peer's sidecar that gets no answer by then failed
    tick_interval_s: float = 0.02
    parent_pid: int = 0
    # Port of the Prometheus endpoint on the control address's host (GET /metrics); 0: none.
    metrics_port: int = 0
    # Port of the router's door (router_door.py) on the same host; 0: the kernel chooses.
    router_port: int = 0
    # Fault and delay hooks (tests and benchmarks): used only where the sidecar's environment
    # turns test hooks on (hooks.py); None everywhere else.
    hooks: SidecarHooks | None = None
    # What a claim grant must name to be read here (D), and what P's grants name: the engine's
    # layout fingerprint and block size.
    layout: str = ""
    block_size: int = 0
    # Connections that have not yet sent a keyed frame (control/guard.py Strangers): at most this
    # many in total and from one host, each closed when its first frame is not in within
    # `first_frame_s`.
    strangers_max: int = 256
    strangers_per_source: int = 32
    first_frame_s: float = 5.0
    # The engine's worker ranks (tensor parallel size): each holds its shard of every block, has
    # its own sockets (`ipc_paths`), and a read, copy or restore is done when every rank's is.
    ranks: int = 1
    # `kv_checksums`: P sums the blocks of each ticket (its workers) and sends the sums with a
    # read's grant; D has each read's blocks summed and compared.
    checksums: bool = False


class SidecarLaunch(msgspec.Struct, kw_only=True):
    """What the connector hands a new sidecar on its stdin (never argv: `ps` shows argv to every
    local user): its configuration and the deployment secret."""

    config: SidecarConfig
    secret: str


def ipc_paths(ipc_dir: str, ranks: int = 1) -> dict[str, str]:
    """The sidecar's sockets: the scheduler's inbox and decisions, and per worker rank r its
    inbox (`inbox.r`: the sidecar knows a fact's rank by the socket it came in on), its
    decisions (`worker.r`) and, on P, its history copier's (`history.r`: stage, demote, drop;
    in order)."""

    paths = {"inbox": f"ipc://{ipc_dir}/inbox", "scheduler": f"ipc://{ipc_dir}/scheduler"}
    for rank in range(ranks):
        for name in ("inbox", "worker", "history"):
            paths[f"{name}.{rank}"] = f"ipc://{ipc_dir}/{name}.{rank}"
    return paths
