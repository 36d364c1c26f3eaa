"""The reference device: any torch device (the CPU by default), with no streams or graphs."""

from __future__ import annotations

import contextlib
import os
from typing import Sequence

import torch

from inferhal.core.backend import KVGroupLayout, KVStorageRequest
from inferhal.core.paging import planning
from inferhal.core.profile import DeviceProfile, ExecLevel

DTYPES = frozenset({"float32", "bfloat16", "float16", "float8_e4m3fn", "fp4_e2m1"})
# cache.kv_dtype values the reference's ops read (core/paging/formats.py: FP8 and FP4 KV records, kv_records.py)
KV_DTYPE_FEATURES = frozenset({"kv_dtype:fp8", "kv_dtype:fp4"})
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
    from inferhal.backends.reference import matmul

    if batch_invariant:
        products = f"products: F.linear over fixed {matmul.TILE_ROWS}-row tiles (backend.batch_invariant=true)"
    elif torch.device(torch_device).type == "cpu":
        products = matmul.describe()
    else:
        products = f"products: F.linear on {torch_device}"
    return DeviceProfile(
        backend="reference",
        device_name=f"PyTorch {torch.__version__} on {torch_device}",
        torch_device=torch_device,
        exec_level=ExecLevel.DEVICE,
        dtypes=DTYPES,
        # deterministic always (no atomics, fixed orders); batch-invariant only in that mode
        features=frozenset({"deterministic", "paged_attention", "paged_sparse_attention", "fp8_block_linear",
                            "fp4_grouped_gemm", *KV_DTYPE_FEATURES} | ({"batch_invariant"} if batch_invariant else set())),
        memory_bytes=cpu_memory_bytes(),
        compute_units=os.cpu_count() or 1,
        sources={"memory_bytes": "os.sysconf", "peak_bandwidth": "not declared: the reference has no roofline",
                 "products": products},
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
    """One buffer per KV group, ``[layers, blocks_of(group), page_bytes(group)]`` bytes, viewed per layer as
    ``[blocks, slots_per_block, *slot_shape]`` of the group's dtype: exactly
    :func:`~inferhal.core.paging.planning.storage_bytes` (the planner's formula: one source of truth)."""

    def __init__(self, request: KVStorageRequest, device: str = "cpu") -> None:
        self.request = request
        self._buffers = []
        self.groups: dict[str, tuple[torch.Tensor, KVGroupLayout]] = {}  # name -> (its byte buffer, its layout)
        self._caches: dict[tuple[str, int], torch.Tensor] = {}
        for g in request.groups:
            n, page = request.blocks_of(g), planning.page_bytes(g)
            buf = zeroed((len(g.layers) * n, page), device).view(len(g.layers), n, page)
            self._buffers.append(buf)
            self.groups[g.name] = (buf, g)
            nbytes = g.slots_per_block * g.slot_bytes
            for i, layer in enumerate(g.layers):
                self._caches[(g.name, layer)] = buf[i, :, :nbytes].view(g.dtype).view(n, g.slots_per_block, *g.slot_shape)

    def layer_cache(self, group: str, layer: int) -> torch.Tensor:
        try:
            return self._caches[(group, layer)]
        except KeyError:
            raise KeyError(f"no KV cache for layer {layer} in group {group!r}") from None

    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers)


class TorchKVCopier:
    """Whole blocks between a :class:`TorchKVStorage` and host memory (the prefix cache's tiers): one gather or
    scatter per group on its byte buffer, every layer of a block at once (``inferhal_kv_block_copier``)."""

    def __init__(self, storage: TorchKVStorage) -> None:
        self.storage = storage

    def _group(self, group: str, layers: Sequence[int]) -> tuple[torch.Tensor, KVGroupLayout, int]:
        buf, g = self.storage.groups[group]
        if tuple(layers) != tuple(g.layers):
            raise ValueError(f"KV group {group!r} has layers {g.layers}, not {tuple(layers)}")
        return buf, g, g.slots_per_block * g.slot_bytes

    def gather(self, group: str, layers: Sequence[int], block_ids: Sequence[int]) -> list[torch.Tensor]:
        buf, g, nbytes = self._group(group, layers)
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=buf.device)
        raw = buf.index_select(1, idx)[:, :, :nbytes].transpose(0, 1).cpu()  # [n, L, nbytes]
        shape = (len(g.layers), g.slots_per_block, *g.slot_shape)
        return [r.contiguous().view(g.dtype).view(shape) for r in raw]

    def scatter(self, group: str, layers: Sequence[int], block_ids: Sequence[int],
                blocks: Sequence[torch.Tensor]) -> None:
        buf, g, nbytes = self._group(group, layers)
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=buf.device)
        raw = torch.stack([b.reshape(len(g.layers), -1).view(torch.uint8) for b in blocks], dim=1)  # [L, n, nbytes]
        buf[:, idx, :nbytes] = raw.to(buf.device)
