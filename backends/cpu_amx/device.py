"""The cpu_amx device: this process's CPU, when it has AMX bf16 and the kernel builds (see kernels/cpu/lib.py)."""

from __future__ import annotations

import os

import torch

from inferhal.backends.reference import device as ref
from inferhal.core.profile import DeviceProfile, ExecLevel, Probe
from inferhal.kernels.cpu import lib

#: ``backend.options`` cpu_amx reads (none yet)
OPTIONS: dict[str, str] = {}


def probe() -> Probe:
    """Available when the AMX kernel builds and Linux lets this process use AMX tile data. The first probe
    compiles the kernels (cached on disk); importing this module (or lib) does nothing."""
    st = lib.status()
    return Probe(st.available, st.reason)


def check_config(config, backend: str = "cpu_amx") -> None:
    """Refuses options (it reads none) and batch-invariant mode; ``backend``: the name errors give (cpu_avx512
    checks its config here too)."""
    from inferhal.core.errors import UserError

    unknown = sorted(set(config.options) - set(OPTIONS))
    if unknown:
        raise UserError(f"backend.options: unknown option(s) {unknown} for the {backend} backend; it reads none")
    if config.batch_invariant:
        raise UserError(f"backend.batch_invariant=true: {backend} does not offer it (the ops it takes from the "
                        "reference run in their default, batch-dependent mode); use backend=reference")


def profile(backend: str = "cpu_amx", isa: str = "AMX", feature: str = "amx_bf16") -> DeviceProfile:
    """This CPU's profile; ``backend``, ``isa`` (named in the device name) and ``feature``: what cpu_avx512
    gives for itself."""
    return DeviceProfile(
        backend=backend,
        device_name=f"{lib.cpu_model()} ({isa}), PyTorch {torch.__version__}",
        torch_device="cpu",
        exec_level=ExecLevel.DEVICE,  # the kernels run on this very CPU: a hardware result for it
        dtypes=ref.DTYPES,
        features=frozenset({"deterministic", "paged_attention", "paged_sparse_attention", "fp8_block_linear",
                            "fp4_grouped_gemm", feature, *ref.KV_DTYPE_FEATURES}),
        memory_bytes=ref.cpu_memory_bytes(),
        compute_units=os.cpu_count() or 1,
        sources={"memory_bytes": "os.sysconf", "peak_bandwidth": "not declared: no roofline for this CPU yet"},
    )
