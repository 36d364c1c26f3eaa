"""Device query through cuda-python's driver API, and the device profile as data."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from inferhal.core.profile import DeviceProfile, ExecLevel, Probe


@dataclass(frozen=True)
class CudaDeviceInfo:
    name: str
    major: int
    minor: int
    memory_bytes: int
    sm_count: int
    driver_version: int


def query_device(index: int = 0) -> CudaDeviceInfo:
    """cuInit + attributes of device ``index``. Raises RuntimeError with the driver's reason."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise RuntimeError(f"cuda-python is not installed ({exc})") from None

    def check(result):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            name = driver.cuGetErrorName(err)[1]
            raise RuntimeError(f"CUDA driver error {name.decode() if isinstance(name, bytes) else name}")
        return rest[0] if len(rest) == 1 else rest

    try:
        result = driver.cuInit(0)
    except Exception as exc:  # cuda-python raises DynamicLibNotFoundError (a RuntimeError) without libcuda
        raise RuntimeError(f"no CUDA driver: libcuda could not be loaded ({type(exc).__name__})") from None
    check(result)
    count = check(driver.cuDeviceGetCount())
    if count == 0:
        raise RuntimeError("the CUDA driver reports 0 devices")
    if index >= count:
        raise RuntimeError(f"device_index {index} out of range: the CUDA driver reports {count} device(s)")
    dev = check(driver.cuDeviceGet(index))
    attr = driver.CUdevice_attribute
    major = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
    minor = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
    sms = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))
    mem = check(driver.cuDeviceTotalMem(dev))
    raw = check(driver.cuDeviceGetName(256, dev))
    version = check(driver.cuDriverGetVersion())
    name = raw.split(b"\0", 1)[0].decode() if isinstance(raw, bytes) else str(raw)
    return CudaDeviceInfo(name, int(major), int(minor), int(mem), int(sms), int(version))


def probe(interpret: bool, index: int = 0) -> Probe:
    if interpret:
        if importlib.util.find_spec("triton") is None:
            return Probe(False, "interpret=true needs triton, which is not installed")
        return Probe(True, "Triton interpreter on the CPU (TRITON_INTERPRET=1): correctness only, not a hardware result",
                     {"exec_level": "interpreter"})
    try:
        info = query_device(index)
    except RuntimeError as exc:
        return Probe(False, f"{exc} (backend.interpret=true runs the kernels in Triton's CPU interpreter)")
    if info.major < 9:
        return Probe(False, f"{info.name} has compute capability {info.major}.{info.minor}; needs 10.x (or 9.0 degraded)",
                     {"device": info.name})
    level = "" if info.major == 10 else " (SM90: degraded target, Blackwell-only kernels fall back)"
    return Probe(True, f"{info.name}, compute capability {info.major}.{info.minor}, {info.sm_count} SMs{level}",
                 {"device": info.name, "cc": f"{info.major}.{info.minor}", "driver": info.driver_version})


def interpreter_profile() -> DeviceProfile:
    return DeviceProfile(
        backend="cuda_sm100",
        device_name="Triton interpreter (CPU)",
        torch_device="cpu",
        exec_level=ExecLevel.INTERPRETER,
        dtypes=frozenset({"float32", "bfloat16", "float16", "float8_e4m3fn", "fp4_e2m1"}),
        features=frozenset(),
        sources={"all": "interpreter run: no device numbers apply"},
    )
