"""Ops of the cpu_avx512 backend: cpu_amx's ops (:mod:`inferhal.backends.cpu_amx.ops`), with ``linear`` and
``lm_head`` run by the AVX512-BF16 product (``kernels/cpu/avx512_linear.c``) over the same packed weights,
and ``lm_head.argmax`` by the exact int8 screen of the head (``kernels/cpu/head_argmax.c``, AVX512-VNNI).
``linear`` also takes int_block weights (a GGUF's integer blocks, which the gemma3 loader keeps for a bf16
model when the profile claims ``int_block_linear``): up to 8 rows unpacked in registers from one byte a
weight (``kernels/cpu/int_block.py``), more through their bf16 copy; bit-identical either way.

Measured on a 2-core AMD EPYC (Zen 4) VM (``inferhal bench cpu_linear``, docs/performance.md): against
oneDNN's packed bf16 product at Gemma 3 270M's layer shapes, 1.53-2.16x at 1 row, 1.36-1.50x at 8,
1.06-1.19x at 32 (380-416 GFLOP/s), 0.93-1.01x at 256; level with it on the 262,144-row LM head.
"""

from __future__ import annotations

from inferhal.backends.cpu_amx.ops import OP_IDS, products
from inferhal.backends.cpu_amx.ops import provide as _provide

__all__ = ["OP_IDS", "linear", "lm_head", "lm_head_argmax", "provide"]

linear, lm_head, lm_head_argmax = products("avx512")


def provide(level) -> dict:
    return _provide(level, kernel="avx512")
