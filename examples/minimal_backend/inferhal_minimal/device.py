"""The device as data (a CPU), its runtime object, and the KV block pool's memory."""

from __future__ import annotations

import contextlib
import os

import torch

from inferhal.core.profile import DeviceProfile, ExecLevel


def profile() -> DeviceProfile:
    return DeviceProfile(
        backend="minimal",
        device_name=f"CPU via PyTorch {torch.__version__}",
        torch_device="cpu",
        exec_level=ExecLevel.DEVICE,
        dtypes={"float32", "bfloat16"},
        # claim a feature only when it is true: qualify checks batch invariance bitwise for it
        features={"batch_invariant"},
        compute_units=os.cpu_count() or 1,
        # no peak_bandwidth / peak_flops: without declared peaks qualify reports performance as "not measured"
        sources={"peaks": "not declared"},
    )


class MinimalDevice:
    torch_device = torch.device("cpu")

    def synchronize(self) -> None:
        return None

    def stream(self):
        return contextlib.nullcontext()

    def event(self):
        return _Event()

    def memory_stats(self) -> dict[str, int]:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return {"total": total, "free": total // 2}


class _Event:
    def record(self) -> None:
        return None

    def synchronize(self) -> None:
        return None


class KVStorage:
    """One tensor per (group, layer): ``[blocks of the group's pool, slots_per_block, *slot_shape]``."""

    def __init__(self, request) -> None:
        self.request = request
        self._caches = {(g.name, layer): torch.zeros(request.blocks_of(g), g.slots_per_block, *g.slot_shape, dtype=g.dtype)
                        for g in request.groups for layer in g.layers}

    def layer_cache(self, group: str, layer: int) -> torch.Tensor:
        return self._caches[(group, layer)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._caches.values())
