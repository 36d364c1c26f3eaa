"""The prefix cache's lower tiers on their own: LRU per tier, disk files found again by a new tier (a restart),
and every fault (an unwritable folder, a full disk, a corrupt, truncated or foreign file) a miss with a message."""

from __future__ import annotations

import errno
import logging

import pytest
import torch

from inferhal.core.paging.tiers import MAGIC, DiskTier, HostTier, TierError, fingerprint

EXPECT = {"full": (torch.float32, (2, 4, 3)), "rec": (torch.uint8, (1, 4, 6))}


def _entry(seed: int, group: str = "full") -> torch.Tensor:
    dtype, shape = EXPECT[group]
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return torch.randn(shape, generator=g, dtype=dtype)


def _key(i: int, group: str = "full") -> tuple[str, bytes]:
    return (group, i.to_bytes(16, "big"))


class Events:
    def __init__(self):
        self.log = []

    def tier_stored(self, medium, key):
        self.log.append(("stored", medium, key))

    def tier_removed(self, medium, key):
        self.log.append(("removed", medium, key))


def test_host_tier_evicts_least_recently_used_past_its_bytes():
    ev = Events()
    one = _entry(0).numel() * 4
    host = HostTier(3 * one, ev)
    for i in range(3):
        assert host.put(_key(i), _entry(i))
    assert host.get(_key(0)) is not None  # 0 is now the most recently used
    host.put(_key(3), _entry(3))
    assert _key(1) not in host and all(_key(i) in host for i in (0, 2, 3))
    assert host.nbytes == 3 * one and host.evictions == 1
    assert ("removed", "CPU", _key(1)) in ev.log and ("stored", "CPU", _key(3)) in ev.log
    assert not host.put(_key(9), torch.zeros(4 * one, dtype=torch.uint8))  # larger than the tier: not kept
    assert torch.equal(host.get(_key(2)), _entry(2))


def test_disk_tier_round_trip_and_a_restart_finds_the_files(tmp_path):
    disk = DiskTier(str(tmp_path), "fp", 0, EXPECT)
    disk.put(_key(1), _entry(1))
    disk.put(_key(2, "rec"), _entry(2, "rec"))  # a quantised record stays uint8 bytes
    disk.flush()
    assert torch.equal(disk.get(_key(1)), _entry(1))
    disk.close()
    again = DiskTier(str(tmp_path), "fp", 0, EXPECT)  # a new server process on the same folder
    assert _key(1) in again and _key(2, "rec") in again
    got = again.get(_key(2, "rec"))
    assert got.dtype == torch.uint8 and torch.equal(got, _entry(2, "rec"))
    other = DiskTier(str(tmp_path), "other-layout", 0, EXPECT)  # another model's folder: none of them
    assert len(other) == 0
    for t in (again, other):
        t.close()


def test_disk_tier_cap_evicts_oldest_files(tmp_path):
    size = len(MAGIC) + 300  # roughly one file
    disk = DiskTier(str(tmp_path), "fp", 2 * size, EXPECT)
    for i in range(4):
        disk.put(_key(i), _entry(i))
        disk.flush()
    assert disk.nbytes <= 2 * size and _key(3) in disk and _key(0) not in disk
    assert not disk.path(_key(0)).exists() and disk.evictions >= 2
    disk.close()


@pytest.mark.parametrize("damage", ["truncate", "flip", "header", "garbage", "shape"])
def test_a_damaged_file_is_a_miss_reported_and_deleted(tmp_path, caplog, damage):
    disk = DiskTier(str(tmp_path), "fp", 0, EXPECT)
    disk.put(_key(5), _entry(5))
    disk.flush()
    p = disk.path(_key(5))
    raw = bytearray(p.read_bytes())
    if damage == "truncate":
        raw = raw[:-7]
    elif damage == "flip":
        raw[-3] ^= 0x40
    elif damage == "header":
        raw = raw[:len(MAGIC) + 6]
    elif damage == "garbage":
        raw = bytearray(b"not a tier file at all")
    else:  # a file of another shape under this block's name
        other = DiskTier(str(tmp_path / "x"), "fp", 0, {"full": (torch.float32, (1, 2, 3))})
        other.put(_key(5), torch.ones(1, 2, 3))
        other.flush()
        raw = bytearray(other.path(_key(5)).read_bytes())
        other.close()
    p.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        assert disk.get(_key(5)) is None
    assert str(p) in caplog.text and "miss" in caplog.text
    assert not p.exists() and _key(5) not in disk and disk.failures == 1
    disk.close()


def test_an_unwritable_folder_is_refused_naming_the_field(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(TierError, match=r"cache\.disk_tier_dir=.*cannot be used"):
        DiskTier(str(blocker / "tier"), "fp", 0, EXPECT)


def test_a_full_disk_leaves_the_block_out_with_one_warning(tmp_path, caplog, monkeypatch):
    disk = DiskTier(str(tmp_path), "fp", 0, EXPECT)

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(disk, "_write_file", full)
    with caplog.at_level(logging.WARNING):
        for i in range(3):
            disk.put(_key(i), _entry(i))
        disk.flush()
    assert caplog.text.count("No space left on device") == 1  # once per kind of error
    assert len(disk) == 0 and disk.failures == 3 and disk.get(_key(0)) is None
    monkeypatch.undo()
    disk.put(_key(0), _entry(0))  # room again: written
    disk.flush()
    assert torch.equal(disk.get(_key(0)), _entry(0))
    disk.close()


def test_stale_temporary_files_are_removed_at_start(tmp_path):
    d = tmp_path / "fp" / "full"
    d.mkdir(parents=True)
    (d / ("ab" * 16 + ".kvb.tmp123")).write_bytes(b"half a write")
    disk = DiskTier(str(tmp_path), "fp", 0, EXPECT)
    assert list(d.iterdir()) == [] and len(disk) == 0
    disk.close()


def test_fingerprint_differs_by_layout():
    a = fingerprint({"model": "m", "groups": [["full", "full", [0], [8], "torch.float32"]]})
    assert a == fingerprint({"groups": [["full", "full", [0], [8], "torch.float32"]], "model": "m"})
    assert a != fingerprint({"model": "m", "groups": [["full", "full", [0], [8], "torch.bfloat16"]]})
