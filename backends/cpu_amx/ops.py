"""Ops of the cpu_amx backend: ``linear`` on AMX tiles for bf16 dense weights.

``linear`` runs :mod:`inferhal.kernels.cpu.amx` when the activations and the weight are bf16 on the CPU,
the weight is a plain ``[N, K]`` tensor with K a multiple of 32 and there is no bias; it packs each
weight once into the kernel's tile layout and keeps it (:class:`~inferhal.backends.reference.matmul.PackCache`,
dropped with its weight). Every other call (fp32, quantised weights, a bias, other K) runs the
reference's ``linear``, as the op's note says. The other ops are the reference's, visibly
(``inferhal backends``).

Measured on a 2-core Sapphire Rapids VM (see docs/performance.md): 1.7-1.9x oneDNN's bf16 product at 32
rows for Gemma 3 270M's shapes, 1.3-1.6x at 1-8 rows, about even at 256 rows.
"""

from __future__ import annotations

import torch

from inferhal.backends.reference import matmul
from inferhal.backends.reference.ops import linear as reference_linear
from inferhal.kernels.cpu import amx

#: packed bf16 weights in the AMX tile layout
PACKS = matmul.PackCache(amx.pack)


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    if bias is None and isinstance(w, torch.Tensor) and amx.supports(x, w):
        wp = PACKS.get(w)
        if wp is not None:
            return amx.linear(x, wp, w.shape[0])
    return reference_linear(x, w, bias)


def provide(level) -> dict:
    from inferhal.core.ops.table import OpImpl

    note = ("AMX bf16 kernel (kernels/cpu/amx_linear.c) for bf16 dense weights with K % 32 == 0 and no bias; "
            "other calls run the reference product")
    return {"linear": OpImpl(linear, level, note)}
