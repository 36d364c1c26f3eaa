"""CPU kernels in C, compiled at run time with the system compiler and called through ctypes.

``lib`` builds and loads them (one library); ``amx`` (``amx_linear.c``, ``avx512_linear.c``): the bf16
linear on Intel AMX tiles, or with AVX512-BF16 dot products on CPUs without AMX, over one packed layout;
``elementwise`` (``elementwise.c``): RMSNorm, gated activations and NeoX rotary embedding;
``attention`` (``attention.c``): paged attention and KV writes. All bf16, used by the cpu_amx and
cpu_avx512 backends;
their oracles are the reference ops, their tests are in ``tests/kernels/cpu/``.
"""
