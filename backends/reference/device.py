"""The reference device: any torch device (the CPU by default), with no streams or graphs."""

from __future__ import annotations

import contextlib
import os

import torch

from inferhal.core.backend import KVStorageRequest
from inferhal.core.paging import planning
from inferhal.core.profile import DeviceProfile, ExecLevel

DTYPES = frozenset({"float32", "bfloat16", "float16", "float8_e4m3fn", "fp4_e2m1"})
#: ``backend.options`` the reference reads, with their meaning
OPTIONS = {"torch_device": "the torch device to run on (default cpu)"}


def check_options(options) -> None:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        from inferhal.core.errors import UserError

        known = "; ".join(f"{k}: {v}" for k, v in OPTIONS.items())
        raise UserError(f"backend.options: unknown option(s) {unknown} for the reference backend; known: {known}")


def cpu_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return cpu_memory_bytes() // 2


def profile(torch_device: str = "cpu", batch_invariant: bool = False) -> DeviceProfile:
    """``batch_invariant`` (``backend.batch_invariant=true``): every matrix product over fixed
    row tiles (matmul.py), so a row's result never depends on its batch; slower, hence opt-in."""
    return DeviceProfile(
        backend="reference",
        device_name=f"PyTorch {torch.__version__} on {torch_device}",
        torch_device=torch_device,
        exec_level=ExecLevel.DEVICE,
        dtypes=DTYPES,
        # deterministic always (no atomics, fixed orders); batch-invariant only in that mode
        features=frozenset({"deterministic", "paged_attention", "paged_sparse_attention", "fp8_block_linear",
                            "fp4_grouped_gemm"} | ({"batch_invariant"} if batch_invariant else set())),
        memory_bytes=cpu_memory_bytes(),
        compute_units=os.cpu_count() or 1,
        sources={"memory_bytes": "os.sysconf", "peak_bandwidth": "not declared: the reference has no roofline"},
    )


class ReferenceDevice:
    def __init__(self, torch_device: str = "cpu") -> None:
        self.torch_device = torch.device(torch_device)

    def synchronize(self) -> None:
        return None

    def stream(self):
        return contextlib.nullcontext()

    def event(self):
        return _Event()

    def memory_stats(self) -> dict[str, int]:
        return {"total": cpu_memory_bytes(), "free": available_memory_bytes()}


class _Event:
    def record(self) -> None:
        return None

    def synchronize(self) -> None:
        return None


def zeroed(shape: tuple[int, int], device: str) -> torch.Tensor:
    """A zero-filled uint8 buffer. On the CPU its pages come from the OS as they are first written
    (numpy's calloc: a large allocation is a fresh mapping of zero pages), so a pool sized for the
    budget holds only the blocks in use: ``torch.zeros`` would write, and so commit, every byte
    (1 GiB of the default job's ~4 GB peak before)."""
    if torch.device(device).type == "cpu":
        import numpy as np

        return torch.from_numpy(np.zeros(shape, dtype=np.uint8))
    return torch.zeros(shape, dtype=torch.uint8, device=device)


class TorchKVStorage:
    """The shared block pool, laid out as vLLM does for hybrid models.

    Every group's page (``slots_per_block * slot_bytes``) is padded to one ``page_bytes``; the i-th layer
    of every group views the same ``[num_blocks, page_bytes]`` byte buffer. A block id belongs to one
    group at a time (the block pool guarantees it), so the views never alias live data, and memory is
    ``num_blocks * page_bytes * max(layers per group)`` instead of one pool per group.
    """

    def __init__(self, request: KVStorageRequest, device: str = "cpu") -> None:
        self.request = request
        groups = request.groups
        self.page_bytes = planning.page_bytes(groups)  # the planner's formula: one source of truth
        n_slots = planning.layer_slots(groups)
        self._buffers = [zeroed((request.num_blocks, self.page_bytes), device) for _ in range(n_slots)]
        self._caches: dict[tuple[str, int], torch.Tensor] = {}
        for g in groups:
            nbytes = g.slots_per_block * g.slot_bytes
            for i, layer in enumerate(g.layers):
                raw = self._buffers[i][:, :nbytes]
                self._caches[(g.name, layer)] = raw.view(g.dtype).view(request.num_blocks, g.slots_per_block, *g.slot_shape)

    def layer_cache(self, group: str, layer: int) -> torch.Tensor:
        try:
            return self._caches[(group, layer)]
        except KeyError:
            raise KeyError(f"no KV cache for layer {layer} in group {group!r}") from None

    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers)
