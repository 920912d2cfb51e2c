"""What it takes to run a NIXL agent in an engine process: importing NIXL with a clear error, the
environment UCX and NIXL start with, an agent config whose progress thread pauses between polls,
the metadata an engine hands its peers, and the memory checks and huge pages behind registration.
`nixl.py` builds the transport on these."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading
import time
from typing import Any, Iterable

import msgspec

from .base import TransportError, TransportUnavailable
from .layout import KvLayout

logger = logging.getLogger(__name__)

NIXL_INSTALL_HINT = ("NIXL is not installed: pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1 "
                     "(nixl-cu12==1.5.1 instead when torch is a CUDA 12 build; plus numpy). Do not "
                     "install the plain `nixl` meta package with dependencies: it pulls both CUDA "
                     "wheels and a CUDA torch.")

# UCX settings applied only when the user has not set them, before the agent (and UCX) starts.
# Without GET_ZCOPY, UCX refuses cuda_ipc READs between processes on one GPU without NVLink and
# falls back to TCP: 0.4 GB/s instead of ~940 GB/s on an H200.
UCX_ENV_DEFAULTS_CUDA = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
# NIXL's Python logger prints an INFO line per agent and backend to stdout; engines log enough.
NIXL_ENV_DEFAULTS = {"NIXL_LOG_LEVEL": "WARN"}

METADATA_PROTOCOL = 1


class NixlPeerMetadata(msgspec.Struct, frozen=True):
    """What `local_metadata` returns (msgpack): everything a reader needs to read from us."""

    kind: str  # "nixl": refuse metadata meant for another transport with a clear message
    protocol: int
    engine_id: str
    agent_name: str
    agent_metadata: bytes  # nixl_agent.get_agent_metadata(): connection info + registrations
    layout: KvLayout


METADATA_ENCODER = msgspec.msgpack.Encoder()
METADATA_DECODER = msgspec.msgpack.Decoder(NixlPeerMetadata)


def import_nixl() -> tuple[Any, Any]:
    """Import NIXL on first use; returns (nixl_agent, nixl_agent_config)."""
    for name, value in NIXL_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ModuleNotFoundError as error:
        raise TransportUnavailable(f"{NIXL_INSTALL_HINT} (import failed: {error})") from error
    except ImportError as error:  # e.g. "detected CUDA 12 but nixl-cu12 is not installed"
        raise TransportUnavailable(f"NIXL is installed but cannot load: {error}. {NIXL_INSTALL_HINT}"
                                   ) from error
    return nixl_agent, nixl_agent_config


_CONFIG_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def progress_thread_delay(delay_us: int):
    """Create agents whose progress thread pauses `delay_us` between polls.

    nixl._api builds its `nixlAgentConfig` itself and sets `pthrDelay = 0`; for the duration of
    this block it gets a config class that keeps at least `delay_us` instead.
    """
    if delay_us <= 0:
        yield
        return
    import types

    import nixl._api as api

    bindings = api.nixlBind
    base = bindings.nixlAgentConfig
    field = base.pthrDelay

    class DelayedConfig(base):
        @property
        def pthrDelay(self):
            return field.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value):
            field.__set__(self, max(int(value), delay_us))

    patched = types.SimpleNamespace(**{k: getattr(bindings, k) for k in dir(bindings) if not k.startswith("__")})
    patched.nixlAgentConfig = DelayedConfig
    with _CONFIG_PATCH_LOCK:
        api.nixlBind = patched
        try:
            yield
        finally:
            api.nixlBind = bindings


def nixl_mem_type(device_type: str) -> str:
    if device_type == "cpu":
        return "DRAM"
    if device_type == "cuda":
        return "VRAM"
    raise TransportError(f"NIXL cannot register KV memory on device type {device_type!r}")


def as_str(name: Any) -> str:
    return name.decode() if isinstance(name, (bytes, bytearray)) else str(name)


def release_quietly(handle: Any, what: str) -> bool:
    """Release a NIXL handle; False when NIXL refused (it may still be moving bytes)."""
    try:
        handle.release()
        return True
    except Exception as error:  # NIXL keeps a handle it cannot cancel and retries at teardown
        logger.warning("NIXL could not release %s: %s", what, error)
        return False


def check_layout_matches(layout: KvLayout, kv_caches: dict) -> None:
    """The layout must describe these very tensors: registering one engine's layout with another
    engine's memory would let peers read the wrong addresses."""
    names = list(kv_caches)
    layout_names = [layer.name for layer in layout.layers]
    if names != layout_names:
        raise ValueError(f"kv_caches layers {names} do not match the layout's {layout_names}")
    for tensor, layer in zip(kv_caches.values(), layout.layers):
        if int(tensor.data_ptr()) != layer.base_ptr:
            raise ValueError(f"layer {layer.name!r}: tensor at {tensor.data_ptr():#x} but layout "
                             f"says {layer.base_ptr:#x}; derive the layout from these tensors")


_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux >= 6.1
_HUGE_PAGE_BYTES = 2 << 20


def collapse_into_huge_pages(regions: Iterable[tuple[int, int]]) -> int:
    """Best effort: back the 2 MiB-aligned interior of each (addr, nbytes) region with transparent
    huge pages, synchronously. Returns the bytes collapsed (0 where the kernel refuses: not Linux,
    Linux < 6.1, THP disabled, pinned pages...)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    started = time.perf_counter()
    collapsed_bytes = 0
    for addr, nbytes in regions:
        start = -(-addr // _HUGE_PAGE_BYTES) * _HUGE_PAGE_BYTES
        end = (addr + nbytes) // _HUGE_PAGE_BYTES * _HUGE_PAGE_BYTES
        if end <= start:
            continue
        # MADV_HUGEPAGE first so that khugepaged keeps the range huge; MADV_COLLAPSE converts the
        # pages that are already there, synchronously.
        madvise(start, end - start, _MADV_HUGEPAGE)
        if madvise(start, end - start, _MADV_COLLAPSE) == 0:
            collapsed_bytes += end - start
        else:
            logger.debug("MADV_COLLAPSE refused for %#x+%d: errno %d", start, end - start,
                         ctypes.get_errno())
    logger.info("%d MiB collapsed into huge pages in %.1f ms", collapsed_bytes >> 20,
                (time.perf_counter() - started) * 1e3)
    return collapsed_bytes
