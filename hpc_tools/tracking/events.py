"""TensorBoard event files of scalars: written with TensorBoard's own writer when the ``tensorboard`` package is
installed, else with the small self-contained writer below, byte for byte the same format.

An event file is a sequence of TFRecords (``uint64`` length, masked CRC-32C of the length, the bytes, masked CRC-32C
of the bytes; all little-endian) whose payloads are ``tensorflow.Event`` protobuf messages: first one carrying
``file_version = "brain.Event:2"``, then one per step carrying a ``Summary`` of ``simple_value`` scalars. TensorBoard
reads every file whose name contains ``tfevents`` in a folder (``docs/tracking.md``).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path
from typing import Protocol

FILE_VERSION = "brain.Event:2"
EVENTS_PREFIX = "events.out.tfevents"


class ScalarWriter(Protocol):
    """What a tracker writes scalars through."""

    path: Path

    def add_scalars(self, step: int, scalars: dict[str, float], wall_time: float | None = None) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def tensorboard_installed() -> bool:
    """Whether TensorBoard's own writer can be used (found without importing it)."""
    from importlib.util import find_spec

    return find_spec("tensorboard") is not None


def event_writer(logdir: Path, suffix: str = "", plain: bool = False) -> ScalarWriter:
    """A new event file in ``logdir``: TensorBoard's writer when installed (and ``plain`` is False), else the
    self-contained one."""
    if not plain and tensorboard_installed():
        return TensorBoardWriter(logdir, suffix)
    return PlainEventWriter(logdir, suffix)


def event_files(logdir: Path) -> list[Path]:
    """The event files TensorBoard would read in ``logdir`` (not its subfolders)."""
    logdir = Path(logdir)
    if not logdir.is_dir():
        return []
    return sorted(p for p in logdir.iterdir() if EVENTS_PREFIX in p.name and p.is_file())


def _file_name(suffix: str) -> str:
    # The name TensorBoard's own writer gives (time, host, pid): several writers in one folder never collide.
    return f"{EVENTS_PREFIX}.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{time.monotonic_ns()}{suffix}"


# --- TensorBoard's writer (what torch.utils.tensorboard.SummaryWriter writes through, without importing torch) --------

class TensorBoardWriter:
    """Scalars through ``tensorboard.summary.writer.event_file_writer.EventFileWriter``."""

    def __init__(self, logdir: Path, suffix: str = ""):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        Path(logdir).mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(logdir), max_queue_size=100, flush_secs=10, filename_suffix=suffix)
        self.path = Path(getattr(self._writer, "_file_name", logdir))  # private in TensorBoard: the folder if gone

    def add_scalars(self, step: int, scalars: dict[str, float], wall_time: float | None = None) -> None:
        values = [self._summary.Value(tag=tag, simple_value=float(v)) for tag, v in scalars.items()]
        self._writer.add_event(self._event(wall_time=time.time() if wall_time is None else wall_time, step=int(step),
                                           summary=self._summary(value=values)))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


# --- the self-contained writer ----------------------------------------------------------------------------------------

def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli polynomial, reflected
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``: the checksum TFRecord framing uses."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotate right by 15 bits, add a constant (a CRC of data holding CRCs stays useful)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(payload: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the payload, its masked CRC."""
    length = struct.pack("<Q", len(payload))
    return length + struct.pack("<I", masked_crc32c(length)) + payload + struct.pack("<I", masked_crc32c(payload))


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int64 values are ten-byte two's complement varints
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field_bytes(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def encode_event(wall_time: float, step: int = 0, file_version: str | None = None,
                 scalars: dict[str, float] | None = None) -> bytes:
    """A ``tensorflow.Event`` message: wall_time (1, double), step (2, int64), file_version (3, string),
    summary (5, Summary); Summary.value (1, repeated Value); Value.tag (1, string), Value.simple_value (2, float)."""
    out = bytearray(b"\x09" + struct.pack("<d", wall_time))
    if step:
        out += b"\x10" + _varint(step)
    if file_version is not None:
        out += _field_bytes(3, file_version.encode())
    if scalars:
        values = b"".join(_field_bytes(1, _field_bytes(1, tag.encode()) + b"\x15" + struct.pack("<f", float(v)))
                          for tag, v in scalars.items())
        out += _field_bytes(5, values)
    return bytes(out)


class PlainEventWriter:
    """An event file written without TensorBoard installed (flushed after every step: a live view sees it)."""

    def __init__(self, logdir: Path, suffix: str = ""):
        logdir = Path(logdir)
        logdir.mkdir(parents=True, exist_ok=True)
        self.path = logdir / _file_name(suffix)
        self._f = open(self.path, "wb")
        self._f.write(tfrecord(encode_event(time.time(), file_version=FILE_VERSION)))
        self._f.flush()

    def add_scalars(self, step: int, scalars: dict[str, float], wall_time: float | None = None) -> None:
        event = encode_event(time.time() if wall_time is None else wall_time, int(step), scalars=scalars)
        self._f.write(tfrecord(event))
        self._f.flush()

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
