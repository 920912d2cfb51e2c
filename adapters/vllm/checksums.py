"""Block checksums (`kv_checksums`, opt-in): P sums the blocks of each ticket it issues, D sums the
blocks it read into and compares, so KV that changed on the way (a faulty link or NIC, memory
overwritten by another writer, a transport bug) is recomputed instead of decoded from.

A block's checksum is a position-weighted sum, modulo 2^64, of the 32-bit words of its bytes over
every layer of this rank's KV cache: every word counts, and two words trading places change it. It
is computed on the device the cache lives on, a chunk of blocks per reduction (a few kernels per
chunk and layer, not a loop over blocks on the host), on a stream of its own so it neither waits
for nor holds up the engine's queued work. With the same layout fingerprint and tensor parallel
size, P's rank r and D's rank r hold the same bytes for a block, so their sums agree exactly.
"""

from __future__ import annotations

import math
import threading
from typing import Any

# Blocks summed per reduction: bounds the temporary (a chunk's words widened to 64 bits).
CHUNK_BYTES = 32 << 20
# Weights run 1..WEIGHT_PERIOD along a block's words (a prime: no layout stride aligns with it).
WEIGHT_PERIOD = 65521


class BlockSummer:
    """Per-block checksums of one worker rank's KV cache (the layers it holds)."""

    def __init__(self, kv_caches: dict[str, Any], block_dims: list[int] | None) -> None:
        import torch

        from .history_slots import block_first_pieces

        self.torch = torch
        self.pieces: list = []
        seen = set()
        for index, tensor in enumerate(kv_caches.values()):
            ident = (int(tensor.data_ptr()), tuple(tensor.shape), tuple(tensor.stride()))
            if ident in seen:  # layers that share a cache are summed once
                continue
            seen.add(ident)
            self.pieces += block_first_pieces(tensor, block_dims[index] if block_dims is not None else 0)
        if not self.pieces:
            raise ValueError("no KV cache layers to checksum")
        self.device = self.pieces[0].device
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.lock = threading.Lock()  # the io thread sums P's blocks, the engine thread D's
        self.weights: dict[tuple[int, Any], Any] = {}

    def _weights(self, words: int):
        key = (words, self.device)
        found = self.weights.get(key)
        if found is None:
            torch = self.torch
            found = (torch.arange(words, dtype=torch.int64, device=self.device) % WEIGHT_PERIOD) + 1
            self.weights[key] = found
        return found

    def sums(self, blocks) -> list[int]:
        """The checksum of each block in `blocks`, in order (a block named twice: twice)."""

        blocks = [int(b) for b in blocks]
        if not blocks:
            return []
        torch = self.torch
        with self.lock:
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    total = self._sum(blocks)
                self.stream.synchronize()
            else:
                total = self._sum(blocks)
            return [int(x) for x in total.cpu().tolist()]

    def _sum(self, blocks: list[int]):
        torch = self.torch
        index = torch.tensor(blocks, dtype=torch.long, device=self.device)
        total = torch.zeros(len(blocks), dtype=torch.int64, device=self.device)
        for piece in self.pieces:
            row_bytes = math.prod(piece.shape[1:]) * piece.element_size()
            step = max(1, CHUNK_BYTES // max(1, row_bytes * 8))
            for start in range(0, len(blocks), step):
                rows = piece.index_select(0, index[start:start + step]).reshape(-1)
                words = _words(torch, rows).reshape(min(step, len(blocks) - start), -1)
                weighted = words.to(torch.int64) * self._weights(words.shape[1])
                total[start:start + step] += weighted.sum(dim=1)
        return total

    def corrupt(self, block: int) -> None:
        """Test hook: change one word of `block` (the reader's copy), as a faulty link would."""

        with self.lock:
            piece = self.pieces[0]
            row = piece[int(block)].reshape(-1)
            words = _words(self.torch, row)
            words[0] += 1


def _words(torch, flat):
    """The contiguous 1-D tensor `flat` as 32-bit words where its size allows, else 16 or 8 bits."""

    raw = flat.view(torch.uint8)
    if raw.numel() % 4 == 0:
        return raw.view(torch.int32)
    if raw.numel() % 2 == 0:
        return raw.view(torch.int16)
    return raw
