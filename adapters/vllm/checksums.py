"""Block checksums (`kv_checksums`, opt-in): P sums the blocks of each ticket it issues, D sums the
blocks it read into and compares, so KV that changed on the way (a faulty link or NIC, memory
overwritten by another writer, a transport bug) is recomputed instead of decoded from.

A block's checksum is a position-weighted sum, modulo 2^64, of the words of its bytes over every
layer of this rank's KV cache, each layer piece (a layer's K or V half) weighted by an odd
constant of its own: every word counts, two words of a row trading places change it, and so do two
pieces (K and V, two layers) trading places. It is computed on the device the cache lives on, a
chunk of blocks per reduction (a few kernels per chunk and piece, not a loop over blocks on the
host), on a stream of its own. P's sums wait for nothing (a ticket's blocks were written by steps
that ended); D's wait for the work queued on the engine thread's stream, which holds the landing
area's scatter of the read (and possibly a queued forward: the price of checking). With the same
layout fingerprint and tensor parallel size, P's rank r and D's rank r hold the same bytes for a
block, so their sums agree exactly.
"""

from __future__ import annotations

import math
import threading
from typing import Any

# Blocks summed per reduction: bounds the temporary (a chunk's words widened to 64 bits).
CHUNK_BYTES = 32 << 20
# Each piece's sums are multiplied by an odd constant of its own (the 64-bit golden ratio times
# the piece's number, made odd), so pieces that trade places change a block's checksum.
PIECE_MULTIPLIER = 0x9E3779B97F4A7C15


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
            found = torch.arange(1, words + 1, dtype=torch.int64, device=self.device)
            self.weights[key] = found
        return found

    def sums(self, blocks, after_engine: bool = False) -> list[int]:
        """The checksum of each block in `blocks`, in order (a block named twice: twice).
        `after_engine`: first wait for what the calling thread's current stream has queued (D:
        the landing area's scatter of a read that just ended)."""

        blocks = [int(b) for b in blocks]
        if not blocks:
            return []
        torch = self.torch
        with self.lock:
            if self.stream is None:
                return [int(x) for x in self._sum(blocks).tolist()]
            if after_engine:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                # The copy to the host runs on this stream and waits for it alone.
                return [int(x) for x in self._sum(blocks).cpu().tolist()]

    def _sum(self, blocks: list[int]):
        torch = self.torch
        index = torch.tensor(blocks, dtype=torch.long, device=self.device)
        total = torch.zeros(len(blocks), dtype=torch.int64, device=self.device)
        for number, piece in enumerate(self.pieces):
            row_bytes = math.prod(piece.shape[1:]) * piece.element_size()
            word = 4 if row_bytes % 4 == 0 else (2 if row_bytes % 2 == 0 else 1)
            step = max(1, CHUNK_BYTES // max(1, row_bytes // word * 8))
            multiplier = _signed((PIECE_MULTIPLIER * (number + 1)) | 1)
            for start in range(0, len(blocks), step):
                count = min(step, len(blocks) - start)
                rows = piece.index_select(0, index[start:start + count]).reshape(count, -1)
                words = _words(torch, rows, word)
                weighted = words.to(torch.int64) * self._weights(words.shape[1])
                total[start:start + count] += weighted.sum(dim=1) * multiplier
        return total

    def corrupt(self, block: int) -> None:
        """Test hook: change one value of `block` (the reader's copy), as a faulty link would."""

        with self.lock:
            row = self.pieces[0][int(block)]
            row[(0,) * row.dim()] += 1  # in place, through whatever view the piece is


def _words(torch, rows, word: int):
    """Contiguous `rows` (one per block) as rows of `word`-byte signed words."""

    raw = rows.contiguous().view(torch.uint8)
    return raw if word == 1 else raw.view({4: torch.int32, 2: torch.int16}[word])


def _signed(value: int) -> int:
    """`value` modulo 2^64 as a signed 64-bit integer (what torch's int64 holds)."""

    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value
