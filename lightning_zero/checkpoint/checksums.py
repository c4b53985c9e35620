"""The CRC-32 of a file that ``torch.save`` just wrote, without reading its data back.

[Note: the CRC-32 of a saved file from its zip records]
``torch.save`` writes a zip archive of uncompressed records (the pickle, one record per storage, a few small
ones) and computes the CRC-32 of every record as it writes it, into the archive's central directory. The CRC-32
of the whole file (what metadata.json lists, see [Note: checksums of a sharded checkpoint]) follows from those:
the file is a sequence of segments (local headers and data descriptors, each record's data, the central
directory), and ``crc(A + B) = combine(crc(A), crc(B), len(B))``. :func:`saved_file_digest` reads the central
directory and every byte that is not a large record's data (a few KiB a record: headers, descriptors, small
records, the directory) and combines their CRC-32 with the large records' CRC-32 from the directory: one pass
over the data (torch.save's) instead of two more (reading the file back, a copy, and computing its CRC-32).

What it trusts: that torch.save's CRC-32 of each record is the CRC-32 of the bytes it wrote there. It checks
that on the records it reads (small ones, among them the pickle, which every file has), so a writer that did not
compute them (``torch.serialization.set_crc32_options(False)`` writes 0) or any archive it does not understand
(compressed records, records that overlap or leave the file) falls back to reading the whole file
(:func:`~lightning_zero.checkpoint.metadata.file_digest`). Either way the result is the CRC-32 of the file's
bytes; a load reads them all and compares.
"""

from __future__ import annotations

import functools
import os
import struct
import zipfile
import zlib
from pathlib import Path
from typing import BinaryIO

from lightning_zero.checkpoint.metadata import file_digest

_POLY = 0xEDB88320  # CRC-32 (zlib's), bit-reflected
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length
_SMALL = 1 << 16  # records up to this size are read and checked, not trusted


def _multiply(a: int, b: int) -> int:
    """``a(x) * b(x)`` modulo the CRC-32 polynomial (bit-reflected: x^0 is the top bit)."""
    product = 0
    bit = 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


@functools.cache
def _x_to_2_to_the(k: int) -> int:
    """``x^(2^k)`` modulo the polynomial."""
    return 1 << 30 if k == 0 else _multiply(_x_to_2_to_the(k - 1), _x_to_2_to_the(k - 1))


@functools.lru_cache(maxsize=1024)
def _shift(length: int) -> int:
    """``x^(8 * length)`` modulo the polynomial: appending ``length`` zero bytes to a message, for its CRC."""
    power, k, n = 1 << 31, 3, length
    while n:
        if n & 1:
            power = _multiply(_x_to_2_to_the(k), power)
        n >>= 1
        k += 1
    return power


def crc32_combine(first: int, second: int, second_length: int) -> int:
    """The CRC-32 of ``A + B`` from ``first = crc32(A)``, ``second = crc32(B)`` and ``len(B)`` (zlib's
    ``crc32_combine``, which Python's ``zlib`` lacks)."""
    return _multiply(_shift(second_length), first) ^ second


def saved_file_digest(file: Path) -> dict[str, int]:
    """Size and CRC-32 of ``file``, a ``torch.save`` archive, from its records' CRC-32 (see [Note: the CRC-32 of a
    saved file from its zip records]); falls back to reading it whole where the archive does not allow that."""
    try:
        digest = _from_records(file)
    except (OSError, zipfile.BadZipFile, ValueError, struct.error):
        digest = None
    return digest if digest is not None else file_digest(file)


def _from_records(file: Path) -> dict[str, int] | None:
    with open(file, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        records = sorted(zipfile.ZipFile(handle).infolist(), key=lambda info: info.header_offset)
        crc, done, checked = 0, 0, 0
        for record in records:
            if record.compress_type != zipfile.ZIP_STORED or record.header_offset < done:
                return None
            handle.seek(record.header_offset)
            signature, name_length, extra_length = _LOCAL_HEADER.unpack(handle.read(_LOCAL_HEADER.size))
            if signature != b"PK\x03\x04":
                return None
            start = record.header_offset + _LOCAL_HEADER.size + name_length + extra_length
            end = start + record.compress_size
            if end > size:
                return None
            if record.compress_size <= _SMALL:  # read like the headers before it, and its CRC-32 checked
                data = _read(handle, done, end - done)
                if zlib.crc32(memoryview(data)[start - done :]) != record.CRC:
                    return None  # the writer's CRC-32 cannot be trusted
                crc, checked = zlib.crc32(data, crc), checked + 1
            else:
                crc = zlib.crc32(_read(handle, done, start - done), crc)
                crc = crc32_combine(crc, record.CRC, record.compress_size)
            done = end
        if not checked:
            return None  # no record to check the writer's CRC-32 on (torch.save always writes small ones)
        crc = zlib.crc32(_read(handle, done, size - done), crc)
    return {"bytes": size, "crc32": crc}


def _read(handle: BinaryIO, offset: int, length: int) -> bytes:
    handle.seek(offset)
    data = handle.read(length)
    if len(data) != length:
        raise ValueError("the file is shorter than its records")
    return data
