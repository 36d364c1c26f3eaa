"""Ops of the cpu_avx512 backend: cpu_amx's ops (:mod:`inferhal.backends.cpu_amx.ops`), with ``linear`` and
``lm_head`` run by the AVX512-BF16 product (``kernels/cpu/avx512_linear.c``) over the same packed weights.

Measured on a 2-core AMD EPYC (Zen 4) VM (see docs/performance.md): the kernel at 340-410 GFLOP/s for Gemma
3 270M's products at 32 rows, 1.1-1.5x oneDNN's bf16 product there, 2.6x at 8 rows, level with it on the
262,144-row LM head (32 ms at 32 rows, compute-bound) and at 256 rows.
"""

from __future__ import annotations

from inferhal.backends.cpu_amx.ops import OP_IDS, products
from inferhal.backends.cpu_amx.ops import provide as _provide

__all__ = ["OP_IDS", "linear", "lm_head", "provide"]

linear, lm_head = products("avx512")


def provide(level) -> dict:
    return _provide(level, kernel="avx512")
