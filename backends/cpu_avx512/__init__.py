"""The cpu_avx512 backend: CPUs with AVX512-BF16 but no AMX (AMD Zen 4 and later, Intel Cooper Lake); bf16
products with ``vdpbf16ps`` and the cpu_amx backend's AVX-512 kernels for everything else."""
