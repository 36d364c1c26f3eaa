"""A guard that catches host synchronisations in a step, on any device (the CPU included).

A device graph replays the kernels a step launched; a step whose code reads a device value on the host
(``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``, ``.cpu()``) or runs an op whose output shape depends
on device data (``nonzero``, ``unique``, boolean-mask indexing, ``repeat_interleave`` without
``output_size``, ``bincount``, ``masked_select``) cannot be captured, and a shape taken from such a read
would be baked into the graph. On the CPU nothing synchronises, so the guard finds these calls by what
they are: a torch function mode (tensor methods) and a dispatch mode (aten ops).

Scope: the guard raises for a read that **core or model code** issues (the innermost frame of this
repository that is not under ``backends/`` or ``kernels/``), and records, without raising, the reads
a backend's ops make (``backend_reads``): an op's implementation is the backend's contract, and the
reference backend's ops are not what a device graph captures (the device's own sync guard,
``Device.forbid_host_sync``, checks a device backend's ops on the device; ``core/qualify/device_run``).
Checking the real ops rather than sync-free fakes keeps the step's outputs real, so the same run shows
the tokens unchanged; and several op contracts set an output shape from device data (``indexer.scores``'
width), which no fake could honour without the sync.

``torch.tensor``/``torch.as_tensor`` of host data inside the step count as reads too: a graph would keep
the values of the capture.

``HostSyncGuard(backend_fatal=True)`` raises for a backend's reads too (a device backend's launch code that
must stay capturable: its tests under tests/backends/ run it so); :meth:`HostSyncGuard.report` lists the
counted reads by place. One read counts once: the aten op a host method issues (``int(t)`` dispatches
``_local_scalar_dense``) is not counted again.
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep  # the repository
_BACKEND_DIRS = ("backends" + os.sep, "kernels" + os.sep)

#: tensor methods and functions that read device data on the host (or bring host data into the step)
HOST_METHODS = frozenset({"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
                          "__array__", "__complex__"})
HOST_FUNCTIONS = frozenset({"tensor", "as_tensor"})
#: aten ops whose result needs a device value on the host (a scalar read, or an output shape from data)
DATA_DEPENDENT = frozenset({"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "unique",
                            "_unique", "_unique2", "unique_dim", "unique_consecutive", "bincount", "histc",
                            "argwhere"})


class HostSyncError(RuntimeError):
    """A host synchronisation inside a guarded step; the message names the call and where core made it."""


def _where() -> tuple[str, bool]:
    """``("path:line function", in_backend)`` of the innermost frame of this repository."""
    f = sys._getframe(1)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        rel = path[len(_ROOT):]
        if path.startswith(_ROOT) and not rel.startswith(".") and "site-packages" not in rel \
                and not path.endswith(os.sep + "host_sync.py"):  # this repository's code, not a venv in it
            return f"{rel}:{f.f_lineno} {f.f_code.co_name}", rel.startswith(_BACKEND_DIRS)
        f = f.f_back
    return "outside inferhal", True


class _Functions(TorchFunctionMode):
    def __init__(self, guard: "HostSyncGuard") -> None:
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_METHODS or (name in HOST_FUNCTIONS and func in (torch.tensor, torch.as_tensor)
                                    and not isinstance(args[0] if args else None, torch.Tensor)):
            self.guard.seen(f"{name}()")
            self.guard._within += 1  # the aten read this method issues is the same read
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.guard._within -= 1
        return func(*args, **(kwargs or {}))


class _Dispatch(TorchDispatchMode):
    def __init__(self, guard: "HostSyncGuard") -> None:
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if self.guard._within:  # inside a host method already counted
            pass
        elif name in DATA_DEPENDENT:
            self.guard.seen(f"aten.{name}")
        elif name == "repeat_interleave" and kwargs.get("output_size") is None \
                and func._overloadname in ("Tensor", "self_Tensor"):  # repeats from a tensor
            self.guard.seen("aten.repeat_interleave without output_size")
        elif name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) or ()):
            self.guard.seen(f"aten.{name} with a boolean mask")
        return func(*args, **kwargs)


class HostSyncGuard:
    """``with HostSyncGuard(): step()``: raises :class:`HostSyncError` at the first host read core code makes
    (see the module docstring); ``backend_reads`` counts the reads each backend op location made
    (``"what at path:line function"``). ``backend_fatal``: raise at a backend's read as well."""

    def __init__(self, backend_fatal: bool = False) -> None:
        self.backend_reads: collections.Counter[str] = collections.Counter()
        self.backend_fatal = backend_fatal
        self._modes: list[Any] = []
        self._busy = False
        self._within = 0

    def report(self) -> list[str]:
        """The backend's counted reads, one line each (``count  what at path:line function``), by place."""
        return [f"{n:4d}  {k}" for k, n in sorted(self.backend_reads.items(), key=lambda kv: kv[0].split(" at ")[::-1])]

    def seen(self, what: str) -> None:
        if self._busy:  # a read made while the guard formats its own message
            return
        self._busy = True
        try:
            where, in_backend = _where()
        finally:
            self._busy = False
        if in_backend and not self.backend_fatal:
            self.backend_reads[f"{what} at {where}"] += 1
            return
        raise HostSyncError(f"host synchronisation in a step: {what} at {where}")

    def __enter__(self) -> "HostSyncGuard":
        self._modes = [_Functions(self), _Dispatch(self)]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
        self._modes = []
