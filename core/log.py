"""The event log: what an engine's ledger saw, byte for byte, so it can be replayed.

Layout:

    magic  b"KVBATON\\n"                      8 bytes
    header u32 length | msgpack(LogHeader) | u32 crc32
    record u32 length | msgpack(Record)    | u32 crc32      (repeated)

A `Record` is `[seq, event, state_hash]`: `seq` counts from 1 without gaps; `state_hash` is the
ledger's hash *after* the event, written every `hash_every` records (else null). A record with a
null event is a checkpoint: just a hash (the writer adds one when it closes).

Readers never raise a traceback at the user: a truncated, corrupt or too-new log raises `LogError`
naming the byte offset and the record.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from typing import BinaryIO

import msgspec

from .events import AnyEvent
from .ledger import STATE_HASH_VERSION, LedgerConfig

MAGIC = b"KVBATON\n"
# 2: D's loads log what P granted (ClaimGranted carries the grant; the load machine decides
# whether it may be read). Older logs replay only with the kvbaton that wrote them: replaying
# their claims here would refuse every grant and tell another story than the engine lived.
SCHEMA_VERSION = 2
OLDEST_SCHEMA = 2
_U32 = struct.Struct("<I")
MAX_RECORD_BYTES = 16 << 20


class LogRecordError(ValueError):
    """An event the writer refuses to record (unencodable or over the record bound)."""


class LogError(Exception):
    """A log that cannot be read; the message names where and why."""

    def __init__(self, offset: int, message: str, *, truncated: bool = False) -> None:
        super().__init__(f"at byte {offset}: {message}")
        self.offset = offset
        self.truncated = truncated  # the data ends inside this frame (a log still being written)


class LogHeader(msgspec.Struct, kw_only=True):
    schema: int = SCHEMA_VERSION
    writer: str = ""
    engine: str = ""
    role: str = ""
    config: LedgerConfig = msgspec.field(default_factory=LedgerConfig)
    hash_every: int = 0
    hash_version: int = STATE_HASH_VERSION


class Record(msgspec.Struct, array_like=True):
    seq: int
    event: AnyEvent | None = None
    state_hash: str | None = None


_HEADER_PROBE = msgspec.msgpack.Decoder(dict)
_HEADER_DECODER = msgspec.msgpack.Decoder(LogHeader)
_RECORD_DECODER = msgspec.msgpack.Decoder(Record)


def _frame(payload: bytes) -> bytes:
    return _U32.pack(len(payload)) + payload + _U32.pack(zlib.crc32(payload))


class LogWriter:
    """Appends framed records. Not thread-safe: one writer per ledger, owned by its shell."""

    def __init__(self, stream: BinaryIO, header: LogHeader) -> None:
        if not header.writer:
            header.writer = f"kvbaton core, log schema {SCHEMA_VERSION}"
        self.stream = stream
        self.header = header
        self.seq = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer = bytearray()
        self._buffer += MAGIC
        self._buffer += _frame(self._encoder.encode(header))
        self.flush()

    @classmethod
    def open(cls, path: str, header: LogHeader) -> "LogWriter":
        return cls(open(path, "wb"), header)

    def encode_checked(self, event) -> bytes:
        """The record this event would become, or LogRecordError when it cannot be written
        (unencodable, or larger than any reader accepts). Nothing is advanced."""

        try:
            payload = self._encoder.encode(Record(self.seq + 1, event, None))
        except (TypeError, ValueError, OverflowError) as exc:
            raise LogRecordError(f"event {type(event).__name__} cannot be encoded: {exc}") from None
        if len(payload) > MAX_RECORD_BYTES:
            raise LogRecordError(f"event {type(event).__name__} needs {len(payload)} bytes, over the "
                                 f"{MAX_RECORD_BYTES}-byte record bound")
        return payload

    def append(self, event, ledger=None) -> None:
        """Record one event; `ledger` (already updated) supplies the periodic state hash.

        The record is encoded before the sequence advances, so a record that cannot be written
        (LogRecordError) leaves no gap: the log still replays."""

        seq = self.seq + 1
        every = self.header.hash_every
        digest = ledger.state_hash() if (every and ledger is not None and seq % every == 0) else None
        try:
            payload = self._encoder.encode(Record(seq, event, digest))
        except (TypeError, ValueError, OverflowError) as exc:
            raise LogRecordError(f"event {type(event).__name__} cannot be encoded: {exc}") from None
        if len(payload) > MAX_RECORD_BYTES:
            raise LogRecordError(f"event {type(event).__name__} needs {len(payload)} bytes, over the "
                                 f"{MAX_RECORD_BYTES}-byte record bound")
        self.seq = seq
        buf = self._buffer
        buf += _U32.pack(len(payload))
        buf += payload
        buf += _U32.pack(zlib.crc32(payload))
        if len(buf) > 1 << 16:
            self.flush()

    def checkpoint(self, ledger) -> None:
        self.seq += 1
        self._buffer += _frame(self._encoder.encode(Record(self.seq, None, ledger.state_hash())))

    def flush(self) -> None:
        if self._buffer:
            self.stream.write(self._buffer)
            self._buffer = bytearray()
        self.stream.flush()

    def close(self, ledger=None) -> None:
        if ledger is not None:
            self.checkpoint(ledger)
        self.flush()
        self.stream.close()


def _read_frame(data: memoryview, offset: int, what: str) -> tuple[bytes, int]:
    if offset + 4 > len(data):
        raise LogError(offset, f"truncated {what}: length prefix cut short", truncated=True)
    (length,) = _U32.unpack_from(data, offset)
    if length > MAX_RECORD_BYTES:
        raise LogError(offset, f"corrupt {what}: length {length} is implausible")
    end = offset + 4 + length + 4
    if end > len(data):
        raise LogError(offset, f"truncated {what}: needs {end - offset} bytes, {len(data) - offset} left",
                       truncated=True)
    payload = bytes(data[offset + 4 : offset + 4 + length])
    (crc,) = _U32.unpack_from(data, offset + 4 + length)
    if zlib.crc32(payload) != crc:
        raise LogError(offset, f"corrupt {what}: checksum mismatch")
    return payload, end


def read_header(data: bytes) -> tuple[LogHeader, int]:
    view = memoryview(data)
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise LogError(0, "not a kvbaton event log (bad magic)")
    payload, offset = _read_frame(view, len(MAGIC), "header")
    try:
        raw = _HEADER_PROBE.decode(payload)
    except msgspec.DecodeError as exc:
        raise LogError(len(MAGIC), f"corrupt header: {exc}") from None
    schema = raw.get("schema") if isinstance(raw, dict) else None
    if not isinstance(schema, int):
        raise LogError(len(MAGIC), "corrupt header: no schema version")
    if schema > SCHEMA_VERSION:
        raise LogError(len(MAGIC), f"log schema {schema} is newer than this kvbaton reads "
                                   f"(up to {SCHEMA_VERSION}); upgrade kvbaton to replay it")
    if schema < OLDEST_SCHEMA:
        raise LogError(len(MAGIC), f"log schema {schema} is older than this kvbaton reads "
                                   f"({OLDEST_SCHEMA} to {SCHEMA_VERSION}): its decode engine's claims "
                                   f"do not record what P granted; replay it with the kvbaton that wrote it")
    try:
        header = _HEADER_DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise LogError(len(MAGIC), f"corrupt header: {exc}") from None
    return header, offset


def iter_records(data: bytes, offset: int) -> Iterator[tuple[int, Record]]:
    """Yield (byte offset, record); raise `LogError` at the first unreadable one."""

    view = memoryview(data)
    expected = 1
    while offset < len(view):
        payload, end = _read_frame(view, offset, f"record {expected}")
        try:
            record = _RECORD_DECODER.decode(payload)
        except msgspec.DecodeError as exc:
            raise LogError(offset, f"corrupt record {expected}: {exc}") from None
        if record.seq != expected:
            raise LogError(offset, f"record {expected} carries seq {record.seq} (records lost or reordered)")
        yield offset, record
        expected += 1
        offset = end


INT64_MAX = (1 << 63) - 1


def _ints_in_range(value) -> bool:
    """Every int in an event (times, ids' numbers, block ids) fits the int64 the writer uses."""

    if type(value) is int:
        return -INT64_MAX - 1 <= value <= INT64_MAX
    if isinstance(value, (tuple, list)):
        return all(_ints_in_range(item) for item in value)
    return True


def checked_records(data, offset: int) -> Iterator[Record]:
    """`iter_records`, refusing events with out-of-range integers (a hostile or damaged log):
    LogError naming the record."""

    for at, record in iter_records(data, offset):
        event = record.event
        if event is not None and not all(_ints_in_range(getattr(event, f)) for f in event.__struct_fields__):
            raise LogError(at, f"record {record.seq}: {type(event).__name__} holds an integer outside int64")
        yield record


def read_log(path: str) -> tuple[LogHeader, list[Record]]:
    """Read a whole log; raise `LogError` (or `OSError`) with a readable message."""

    with open(path, "rb") as stream:
        data = stream.read()
    header, offset = read_header(data)
    return header, [record for _, record in iter_records(data, offset)]


def read_log_prefix(path: str) -> tuple[LogHeader, list[Record], LogError | None]:
    """Read the records a log holds up to an unfinished last one: a live engine's log ends
    mid-record (the writer flushes in 64 KiB pieces). Returns the truncation that stopped the
    read, or None. Corruption (a bad checksum, a lost record) and a bad header still raise."""

    with open(path, "rb") as stream:
        data = stream.read()
    header, offset = read_header(data)
    records: list[Record] = []
    try:
        for _, record in iter_records(data, offset):
            records.append(record)
    except LogError as exc:
        if not exc.truncated:  # only a frame running past the end is unfinished
            raise
        return header, records, exc
    return header, records, None
