"""A fast, validating GGUF reader: header, metadata and tensor directory, tensor data memory-mapped.

``gguf.GGUFReader`` builds one numpy view per array element and takes ~30 s on a 262k-token vocabulary;
this reader parses the same format (GGUF v2/v3, little-endian) in well under a second. It only reads;
quantised tensors come back as raw block bytes, decoded by :mod:`.dequant`.

Layout: ``"GGUF"`` magic, uint32 version, uint64 tensor count, uint64 metadata count; metadata as
(string key, uint32 type, value); tensor infos as (string name, uint32 n_dims, uint64 dims[n_dims] with
the fastest-varying dim first, uint32 ggml type, uint64 offset); tensor data starts at the next multiple
of ``general.alignment`` (default 32). Every problem raises :class:`GGUFError` (a ``UserError``) naming
the file and what is wrong.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inferhal.core.errors import UserError

MAGIC = b"GGUF"

# GGUF metadata value types → (struct format, numpy dtype) for the fixed-size ones.
_SCALAR = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
    4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
    10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


class GGUFError(UserError):
    """The file is not a readable GGUF model (wrong magic, truncated, unsupported type, ...)."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the directory. ``shape`` is torch order (slowest dim first), e.g. ``[N, K]``."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type#{self.ggml_type}"


class GGUFFile:
    """An open GGUF file: ``metadata`` (key → value; arrays of numbers as numpy arrays, arrays of strings
    as lists), ``tensors`` (name → :class:`TensorInfo`) and :meth:`raw` for a tensor's bytes (zero-copy)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"GGUF file {self.path} does not exist")
        size = self.path.stat().st_size
        if size < 24:
            raise GGUFError(f"{self.path} is not a GGUF file: only {size} bytes")
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = memoryview(self._mm)
        self._pos = 0
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self._parse(size)
        except GGUFError:
            raise
        except (struct.error, IndexError, ValueError, UnicodeDecodeError) as exc:
            raise GGUFError(f"{self.path}: corrupt GGUF header or metadata at byte {self._pos}: {exc}") from None

    # -- parsing ---------------------------------------------------------------------------------
    def _take(self, n: int) -> memoryview:
        if self._pos + n > len(self._buf):
            raise GGUFError(f"{self.path} is truncated: metadata ends past the end of the file (byte {self._pos + n})")
        out = self._buf[self._pos : self._pos + n]
        self._pos += n
        return out

    def _unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        n = self._unpack("<Q")
        if n > len(self._buf):
            raise GGUFError(f"{self.path}: corrupt string length {n} at byte {self._pos - 8}")
        return bytes(self._take(n)).decode("utf-8")

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALAR:
            return self._unpack(_SCALAR[vtype][0])
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._unpack("<I"), self._unpack("<Q")
            if etype in _SCALAR:
                dt = np.dtype(_SCALAR[etype][1]).newbyteorder("<")
                return np.frombuffer(self._take(count * dt.itemsize), dtype=dt).copy()
            if etype == _STRING:
                return self._string_array(count)
            return [self._value(etype) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown metadata value type {vtype} at byte {self._pos - 4}")

    def _string_array(self, count: int) -> list[str]:
        buf, pos, out = self._buf, self._pos, []
        end = len(buf)
        unpack_from = struct.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise GGUFError(f"{self.path} is truncated inside a string array")
            (n,) = unpack_from("<Q", buf, pos)
            pos += 8
            if pos + n > end:
                raise GGUFError(f"{self.path} is truncated inside a string array")
            out.append(str(buf[pos : pos + n], "utf-8", "surrogateescape"))
            pos += n
        self._pos = pos
        return out

    def _parse(self, size: int) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        magic = bytes(self._take(4))
        if magic != MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file: magic {magic!r}, expected {MAGIC!r}")
        self.version = self._unpack("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: unsupported GGUF version {self.version} (supported: 2, 3)")
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise GGUFError(f"{self.path}: corrupt header ({n_tensors} tensors, {n_kv} metadata entries)")
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            ndim = self._unpack("<I")
            if ndim > 8:
                raise GGUFError(f"{self.path}: tensor {name!r} has {ndim} dims")
            dims = [self._unpack("<Q") for _ in range(ndim)]
            gtype, off = self._unpack("<I"), self._unpack("<Q")
            infos.append((name, dims, gtype, off))
        align = int(self.metadata.get("general.alignment", 32))
        self.data_start = self._pos + (-self._pos % align)
        for name, dims, gtype, off in infos:
            try:
                block, tsize = GGML_QUANT_SIZES[GGMLQuantizationType(gtype)]
            except (ValueError, KeyError):
                raise GGUFError(f"{self.path}: tensor {name!r} has unknown ggml type {gtype}") from None
            numel = int(np.prod(dims, dtype=np.int64)) if dims else 1
            if dims and dims[0] % block:
                raise GGUFError(f"{self.path}: tensor {name!r} row of {dims[0]} is not a multiple of block {block}")
            nbytes = numel // block * tsize
            start = self.data_start + off
            if start + nbytes > size:
                raise GGUFError(
                    f"{self.path} is truncated: tensor {name!r} needs bytes {start}..{start + nbytes} "
                    f"but the file has {size} bytes"
                )
            self.tensors[name] = TensorInfo(name, tuple(reversed(dims)), gtype, start, nbytes)

    # -- access ----------------------------------------------------------------------------------
    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array (a view of the memory map)."""
        t = self.tensors[name]
        return np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    def release(self, name: str) -> None:
        """Give back the resident pages of the tensor's bytes (``madvise(MADV_DONTNEED)``; a decoder calls it
        once the tensor is decoded). The mapping is read-only and backed by the file, so a later :meth:`raw`
        reads them from the page cache again; pages shared with a neighbour tensor go too, and come back alike."""
        t = self.tensors[name]
        lo = t.offset // mmap.PAGESIZE * mmap.PAGESIZE
        hi = min(-(-(t.offset + t.nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE, len(self._mm))
        if hi > lo and hasattr(mmap, "MADV_DONTNEED"):
            self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        return self.metadata[key]
