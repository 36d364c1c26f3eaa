"""The cpu_avx512 device: this process's CPU, when it has AVX512-BF16 and the kernels build (kernels/cpu/lib.py)."""

from __future__ import annotations

import os

import torch

from inferhal.backends.cpu_amx import device as amx_device
from inferhal.backends.reference import device as ref
from inferhal.core.profile import DeviceProfile, ExecLevel, Probe
from inferhal.kernels.cpu import lib


def probe() -> Probe:
    """Available when the kernels build on an AVX512-BF16 CPU. The first probe compiles them (cached on disk)."""
    st = lib.avx512_status()
    return Probe(st.available, st.reason)


def check_config(config) -> None:
    amx_device.check_config(config, backend="cpu_avx512")


def profile() -> DeviceProfile:
    return DeviceProfile(
        backend="cpu_avx512",
        device_name=f"{lib.cpu_model()} (AVX512-BF16), PyTorch {torch.__version__}",
        torch_device="cpu",
        exec_level=ExecLevel.DEVICE,  # the kernels run on this very CPU: a hardware result for it
        dtypes=ref.DTYPES,
        features=frozenset({"deterministic", "paged_attention", "paged_sparse_attention", "fp8_block_linear",
                            "fp4_grouped_gemm", "avx512_bf16"}),
        memory_bytes=ref.cpu_memory_bytes(),
        compute_units=os.cpu_count() or 1,
        sources={"memory_bytes": "os.sysconf", "peak_bandwidth": "not declared: no roofline for this CPU yet"},
    )
