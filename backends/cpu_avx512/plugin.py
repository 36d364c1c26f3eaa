"""Hook implementations of the cpu_avx512 backend: cpu_amx's :class:`~inferhal.backends.cpu_amx.plugin.CpuPlugin`
over this package's device, ops and comm modules."""

from __future__ import annotations

from inferhal.backends.cpu_amx.plugin import CpuPlugin

plugin = CpuPlugin("inferhal.backends.cpu_avx512")
