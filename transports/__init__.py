"""Transports: the byte-moving shell of kvbaton (D reads KV blocks out of P's registered cache).

Importing this package imports neither torch nor NIXL; NixlTransport loads NIXL when constructed
and raises TransportUnavailable if it is missing.
"""

from .base import ReadResult, Transport, TransportError, TransportUnavailable
from .layout import (BlockSpan, DescriptorPlan, KvLayout, LayerLayout, LayoutMismatch, MemoryRegion,
                     check_block_ids, coalesce_runs, descriptors_for_runs)
from .local import LocalTransport, UnknownPeer
from .nixl import NixlTransport

__all__ = [
    "BlockSpan", "DescriptorPlan", "KvLayout", "LayerLayout", "LayoutMismatch", "LocalTransport",
    "MemoryRegion", "NixlTransport", "ReadResult", "Transport", "TransportError",
    "TransportUnavailable", "UnknownPeer", "check_block_ids", "coalesce_runs",
    "descriptors_for_runs",
]
