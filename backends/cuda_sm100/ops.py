"""Ops of the cuda_sm100 backend: Triton kernels from inferhal.kernels, wired by op ID.

Kernels are added per op with their conformance tests; until an op has a kernel it falls back to the
reference implementation, visibly (``inferhal backends``) and refused under ``backend.strict=true``.
"""

from __future__ import annotations

#: op ID -> "module:function" of the kernel wrapper in inferhal.kernels (imported lazily).
KERNEL_OPS: dict[str, str] = {}


def provide(level) -> dict:
    import importlib

    from inferhal.core.ops.table import OpImpl

    out = {}
    for op_id, target in KERNEL_OPS.items():
        mod, fn = target.split(":")
        out[op_id] = OpImpl(getattr(importlib.import_module(mod), fn), level)
    return out
