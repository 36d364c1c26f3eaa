"""The reference device's options."""

from __future__ import annotations

import os

import pytest

from inferhal.backends.reference.device import check_options
from inferhal.core.errors import UserError


def test_an_unknown_backend_option_is_named_with_the_known_ones():
    check_options({"torch_device": "cpu"})
    with pytest.raises(UserError, match=r"unknown option\(s\) \['torch_devcie'\].*torch_device"):
        check_options({"torch_devcie": "cpu"})


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc/self/statm (Linux) to read RSS")
def test_cpu_kv_pool_commits_memory_only_where_written():
    """A 512 MiB pool is zero everywhere yet holds (almost) no resident memory until blocks are written."""
    import torch

    from inferhal.backends.reference.device import TorchKVStorage
    from inferhal.core.backend import KVGroupLayout, KVStorageRequest

    req = KVStorageRequest(4096, 16, (KVGroupLayout("full", (0,), 16, (1, 4096), torch.float32),))
    before = _rss_bytes()
    kv = TorchKVStorage(req, "cpu")
    assert kv.nbytes() == 4096 * 16 * 4096 * 4
    cache = kv.layer_cache("full", 0)  # [blocks, slots, 1, 4096] fp32
    assert float(cache[::512].abs().sum()) == 0.0  # zero where never written
    cache[7] = 1.5
    assert float(cache[7].sum()) == 1.5 * 16 * 4096 and float(cache[8].abs().sum()) == 0.0
    assert _rss_bytes() - before < 64 << 20, "the pool's untouched pages became resident"
