"""The repository's own conformance run: every case of every op each backend claims, against the reference.

Defaults (when ``--inferhal-backend`` is not given): the reference (its own ops: numerics trivially exact,
determinism and batch invariance real), the cuda_sm100 backend in Triton's interpreter on the CPU, and
cpu_amx and cpu_avx512 on this CPU (each skipped, with the reason, where it lacks AMX or AVX512-BF16 or
there is no C compiler).
"""

from __future__ import annotations


def pytest_inferhal_default_backends(config):
    return ["reference", "cuda_sm100:interpret", "cpu_amx", "cpu_avx512"]
