"""TensorBoard event files, written without tensorboard's writer.

An event file is a sequence of TFRecords, each a serialized `Event` proto:

    uint64 length, little-endian
    uint32 masked CRC-32C of those 8 bytes
    bytes  data
    uint32 masked CRC-32C of the data

tensorboard's own writer reaches its file through a TensorFlow stub whose file layer
imports boto3 and fsspec (for s3:// and gs:// paths): memory the driver would hold all
run for a local file of a few kilobytes. The protos themselves are light.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from pathlib import Path

from tensorboard.compat.proto.event_pb2 import Event, SourceMetadata

CRC32C_POLYNOMIAL = 0x82F63B78  # Castagnoli, bit-reversed
FILE_NUMBERS = itertools.count()  # a resumed run's file, opened within the same second


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ CRC32C_POLYNOMIAL if crc & 1 else crc >> 1
        table.append(crc)
    return table


CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of `data`, as TFRecord frames use it."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """The CRC as TFRecord stores it: rotated right by 15 bits plus a constant, so that
    a CRC of data that itself holds CRCs does not come out trivially."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    """One TFRecord frame around `data`."""
    length = struct.pack("<Q", len(data))
    return (
        length
        + struct.pack("<I", masked_crc32c(length))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


class EventFile:
    """An event file in `log_dir`, named as TensorBoard's writers name theirs (it reads
    every `events.out.tfevents.*` file of a directory), opened with the version record
    TensorBoard expects first."""

    def __init__(self, log_dir: Path):
        log_dir.mkdir(parents=True, exist_ok=True)
        stamp = f"{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        self.path = log_dir / f"events.out.tfevents.{stamp}.{next(FILE_NUMBERS)}"
        self.file = self.path.open("wb")
        source = SourceMetadata(writer="rlray.observe.event_file")
        version = Event(wall_time=time.time(), file_version="brain.Event:2", source_metadata=source)
        self.write(version)
        self.flush()

    def write(self, event: Event) -> None:
        self.file.write(tfrecord(event.SerializeToString()))

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()
