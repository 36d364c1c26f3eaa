"""Weights that view a read-only file mapping (the disk weight cache), and giving their pages back.

A loader that maps a weight file registers the mapping (:func:`register`). A backend that has made its own
copy of such a weight (a packed layout for its products) calls :func:`release` on the original: the pages
of its bytes leave the process (``madvise(MADV_DONTNEED)``), so a model does not hold every weight twice,
once mapped and once packed. Nothing is lost: the mapping is read-only and backed by the file, so a later
read faults the bytes in again from the page cache. Memory that is not a registered file mapping is never
touched (``MADV_DONTNEED`` on anonymous memory would zero it).
"""

from __future__ import annotations

import mmap
import threading
import weakref
from typing import Any

import torch

_PAGE = mmap.PAGESIZE
_MAPS: dict[int, tuple[int, Any]] = {}  # start address -> (bytes, weak reference to the mmap object)
_LOCK = threading.Lock()


def register(array: Any) -> None:
    """Record a read-only ``numpy.memmap`` whose bytes weights view (the mapping, not a slice of it)."""
    mm = getattr(array, "_mmap", None)
    if mm is None or getattr(array, "mode", "r") != "r":
        return
    start = int(array.ctypes.data)
    with _LOCK:
        for addr in [a for a, (_, ref) in _MAPS.items() if ref() is None]:  # mappings since closed
            del _MAPS[addr]
        _MAPS[start] = (int(array.nbytes), weakref.ref(mm))


def _mapping_of(t: torch.Tensor):
    """(start address, bytes, mmap) of the registered, open file mapping that holds all of ``t``'s bytes, or None."""
    if t.device.type != "cpu":
        return None
    ptr, n = int(t.data_ptr()), t.numel() * t.element_size()
    with _LOCK:
        hit = next(((a, size, ref()) for a, (size, ref) in _MAPS.items() if a <= ptr and ptr + n <= a + size), None)
    return None if hit is None or hit[2] is None or hit[2].closed else hit


def is_mapped(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes lie in a registered read-only file mapping (nothing can write them)."""
    return _mapping_of(t) is not None


def release(t: torch.Tensor) -> int:
    """Give back the resident pages of ``t``'s bytes when they lie in a registered file mapping (only the
    pages wholly inside them, so a neighbour's bytes stay); → the bytes released (0 when ``t`` is not
    mapped). ``t`` stays valid: its bytes are read from the file again if it is used."""
    if not t.is_contiguous():
        return 0
    hit = _mapping_of(t)
    if hit is None:
        return 0
    ptr, n = int(t.data_ptr()), t.numel() * t.element_size()
    start, _, mm = hit
    lo = -(-(ptr - start) // _PAGE) * _PAGE  # offsets into the mapping, rounded inwards to whole pages
    hi = ((ptr + n - start) // _PAGE) * _PAGE
    if hi <= lo:
        return 0
    mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    return hi - lo
