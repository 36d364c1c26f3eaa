"""Giving back the pages of weights that view a mapped weight file: the bytes stay readable (faulted in
again from the file), the process's resident pages of the file drop, and memory that is not a registered
file mapping is never touched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inferhal.core.ops import mapped


def _resident_kb(path) -> int:
    kb, cur = 0, None
    for line in open("/proc/self/smaps"):
        parts = line.split()
        if "-" in parts[0] and not parts[0].endswith(":"):
            cur = parts[5] if len(parts) > 5 else None
        elif parts[0] == "Rss:" and cur == str(path):
            kb += int(parts[1])
    return kb


pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")


def test_release_gives_back_a_mapped_weights_pages_and_keeps_its_bytes(tmp_path):
    path = tmp_path / "weights.bin"
    want = torch.randn(1024, 1024)  # 4 MiB
    path.write_bytes(want.numpy().tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    mapped.register(mm)
    w = torch.from_numpy(mm.view(np.float32).reshape(1024, 1024))
    assert torch.equal(w, want) and _resident_kb(path) >= 4000  # read: resident
    assert mapped.release(w[1:]) == (4 << 20) - 4096  # a view starting mid-page: whole pages inside it only
    assert _resident_kb(path) <= 8
    assert torch.equal(w, want)  # read again from the file


def test_memory_that_is_not_a_registered_mapping_is_left_alone(tmp_path):
    t = torch.randn(1024, 1024)
    copy = t.clone()
    assert mapped.release(t) == 0 and torch.equal(t, copy)  # anonymous memory: MADV_DONTNEED would zero it
    path = tmp_path / "other.bin"
    path.write_bytes(copy.numpy().tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="r")  # mapped but never registered
    w = torch.from_numpy(mm.view(np.float32).reshape(1024, 1024))
    assert torch.equal(w, copy) and mapped.release(w) == 0 and _resident_kb(path) >= 4000
