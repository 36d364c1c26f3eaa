"""CPU kernels in C, compiled at run time with the system compiler and called through ctypes.

``amx`` (``amx_linear.c``): the bf16 linear on Intel AMX tiles, used by the cpu_amx backend. Its oracle
is the reference ``linear``; its tests are in ``tests/kernels/cpu/``.
"""
