"""The cpu_avx512 device: this process's CPU, when it has AVX512-BF16 and the kernels build (kernels/cpu/lib.py)."""

from __future__ import annotations

from dataclasses import replace

from inferhal.backends.cpu_amx import device as amx_device
from inferhal.core.profile import DeviceProfile, Probe
from inferhal.kernels.cpu import lib


def probe() -> Probe:
    """Available when the kernels build on an AVX512-BF16 CPU. The first probe compiles them (cached on disk)."""
    st = lib.avx512_status()
    return Probe(st.available, st.reason)


def check_config(config) -> None:
    amx_device.check_config(config, backend="cpu_avx512")


def profile() -> DeviceProfile:
    p = amx_device.profile("cpu_avx512", "AVX512-BF16", "avx512_bf16")
    # its linear takes int_block weights (a GGUF's integer blocks, kept by the gemma3 loader for bf16 models)
    return replace(p, features=p.features | {"int_block_linear"})
