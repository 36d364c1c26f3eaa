"""A disk cache of dequantised weights, memory-mapped on every load (the way llama.cpp maps a GGUF).

Dequantising the Gemma 3 270M GGUF to fp32 takes a few seconds; the result (1.07 GB) is written once to
``<cache>/weights/<key>/weights.bin`` (tensors back to back, 64-byte aligned) with ``index.json``
(name → offset, shape, dtype). ``key`` hashes the GGUF's resolved path, size and mtime, the target
dtype and :data:`VERSION` (bump it when dequantisation changes), so an edited file or another dtype
never hits a stale entry; int_block weights (a bf16 model's integer blocks, :mod:`.loader`) are stored as
their int8 and fp32 parts under their own key. Mapped tensors are read-only views of the page cache: loading
is ~0.1 s and the pages are shared between processes. They all view one storage over the file, so weights
written back to back (a layer's q, k, v and gate, up, decoded in that order) join as one view where a model fuses
them (:func:`~inferhal.core.ops.quant.cat_rows`): no anonymous copy. Disable with ``INFERHAL_WEIGHT_CACHE=0``.

A miss writes the entry as the weights are decoded, one at a time, each dropped once written, and then maps
it like a hit: a first load holds no more than a later one (plus the one weight being decoded). Holding every
decoded weight until the model was built made ``inferhal generate``'s first run peak at 2.81 GB RSS against a
later run's 2.16 GB; it now peaks at 2.04 GB (Gemma 3 270M fp32, medians of 3, AMD EPYC, shared host).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import numpy as np
import torch

from inferhal.core.ops import mapped
from inferhal.core.ops.quant import QuantWeight, int_block

log = logging.getLogger("inferhal.models.gguf")

VERSION = 2  # 2: output_norm stored minus one like every other Gemma norm
_ALIGN = 64
_NP = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.int16}  # bf16 stored as raw bits


def enabled(dtype: torch.dtype) -> bool:
    return os.environ.get("INFERHAL_WEIGHT_CACHE", "1") != "0" and dtype in _NP


def entry_dir(root: Path, gguf: Path, dtype: torch.dtype, variant: str = "") -> Path:
    st = gguf.stat()
    raw = f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}|{dtype}|v{VERSION}" + (f"|{variant}" if variant else "")
    return root / "weights" / hashlib.sha256(raw.encode()).hexdigest()[:24]


Weight = torch.Tensor | QuantWeight
#: what a build gives: (name, weight) pairs, best produced one at a time, or a mapping
Weights = Iterable[tuple[str, Weight]] | Mapping[str, Weight]


def _pairs(weights: Weights) -> Iterator[tuple[str, Weight]]:
    return iter(weights.items()) if isinstance(weights, Mapping) else iter(weights)


def _parts(name: str, w: Weight) -> list[tuple[str, torch.Tensor]]:
    """An int_block weight as its parts (``name#data``, ``name#scale``, ``name#offset``), a tensor as itself."""
    if not isinstance(w, QuantWeight):
        return [(name, w)]
    out = [(f"{name}#data", w.data), (f"{name}#scale", w.scale)]
    return out + ([(f"{name}#offset", w.offset)] if w.offset is not None else [])


def _unflatten(flat: Mapping[str, torch.Tensor]) -> dict[str, Weight]:
    out = {name: t for name, t in flat.items() if "#" not in name}
    for key in flat:
        name, _, part = key.partition("#")
        if part == "data":
            out[name] = int_block(flat[key], flat[f"{name}#scale"], flat.get(f"{name}#offset"))
    return out


def load(d: Path) -> dict[str, Weight] | None:
    """The cached tensors of entry ``d``, memory-mapped, or None when the entry is absent or unreadable."""
    try:
        index = json.loads((d / "index.json").read_text())
        mm = np.memmap(d / "weights.bin", dtype=np.uint8, mode="r")
        if mm.size != index["nbytes"]:
            return None
        mapped.register(mm)  # a backend that copies a weight may give its mapped pages back
        out = {}
        with warnings.catch_warnings():  # read-only mapping: the model never writes its weights
            warnings.simplefilter("ignore", UserWarning)
            # every weight a view of one storage over the whole file: weights written back to back (a layer's
            # q, k, v; gate, up) are then one tensor's rows, which cat_rows joins without a copy
            flat = torch.from_numpy(mm)
        for name, (off, shape, dt) in index["tensors"].items():
            tdt = torch.bfloat16 if dt == "bfloat16" else torch.from_numpy(np.empty(0, np.dtype(dt))).dtype
            n = int(np.prod(shape, dtype=np.int64)) * tdt.itemsize
            out[name] = flat[off : off + n].view(tdt).view(shape)
        return _unflatten(out)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.debug("weight cache %s unusable: %s", d, exc)
        return None


def _write(f, index: dict, off: int, name: str, t: torch.Tensor) -> int:
    """Append ``t`` at the next aligned offset after ``off``; → the offset after it."""
    t = t.detach().contiguous()
    bf16 = t.dtype == torch.bfloat16
    a = (t.view(torch.int16) if bf16 else t).numpy()
    pad = -off % _ALIGN
    f.write(b"\0" * pad)
    index[name] = (off + pad, list(a.shape), "bfloat16" if bf16 else a.dtype.str)
    f.write(a.reshape(-1).view(np.uint8).data)  # the tensor's own bytes, no copy
    return off + pad + a.nbytes


def store(d: Path, weights: Weights) -> bool:
    """Write entry ``d`` atomically (a temp dir renamed into place), taking each weight of ``weights`` only
    after the previous one is written and let go; → whether it was written (failures only log)."""
    tmp = d.with_name(d.name + f".tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        index, off = {}, 0
        with open(tmp / "weights.bin", "wb") as f:
            for name, w in _pairs(weights):
                for key, t in _parts(name, w):
                    off = _write(f, index, off, key, t)
                del w, t  # before the next weight is decoded
        (tmp / "index.json").write_text(json.dumps({"nbytes": off, "tensors": index}))
        if d.exists():  # an unreadable entry being replaced
            shutil.rmtree(d, ignore_errors=True)
        os.replace(tmp, d)
        return True
    except OSError as exc:
        log.warning("could not write the weight cache %s: %s", d, exc)
        return False
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def cached(root: Path, gguf: Path, dtype: torch.dtype, build: Callable[[], Weights],
           variant: str = "") -> tuple[dict[str, Weight], bool]:
    """(weights, hit): the entry mapped, stored first from ``build()`` on a miss. ``variant`` names what
    else than the dtype shapes the entry (``int_blocks``: int_block weights, kept as their parts). Where
    the cache is off or the entry cannot be written, ``build()``'s weights in memory."""
    if not enabled(dtype):
        return dict(_pairs(build())), False
    d = entry_dir(root, gguf, dtype, variant)
    hit = load(d)
    if hit is not None:
        return hit, True
    if store(d, build()):
        stored = load(d)
        if stored is not None:
            return stored, False
    return dict(_pairs(build())), False
