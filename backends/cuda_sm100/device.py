"""Device query through cuda-python's driver API, the device profile as data, and the runtime device
(streams, events, CUDA graphs through torch.cuda, created lazily: importing this initialises nothing).

Generation differences live here as data (:data:`ARCHS`, :data:`CHIPS`); ops and models ask the
profile's features, never the chip.
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable

from inferhal.core.errors import UserError
from inferhal.core.profile import DeviceProfile, ExecLevel, Probe

DTYPES = frozenset({"float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "fp4_e2m1"})

#: cache.kv_dtype values the kernels read (kernels/kv_records.py: kv.write encodes, attn.sparse_topk and
#: indexer.scores decode FP8/FP4 records in their key tiles; verified in the interpreter, compiled for sm_100a)
KV_RECORDS = frozenset({"kv_dtype:fp8", "kv_dtype:fp4"})

#: Capability data per compute capability (major, minor). ``degraded`` names each feature the
#: kernels need a Blackwell-only instruction for, and what happens instead on that target.
ARCHS: dict[tuple[int, int], dict[str, Any]] = {
    (10, 0): {"arch": "sm_100a", "kernel_target": "cuda_sm100", "mma": "tcgen05",
              "features": {"tcgen05", "tensor_memory", "fp8_block_linear", "fp4_grouped_gemm", "mxfp4_mma",
                           "paged_attention", "paged_sparse_attention", "cuda_graphs", *KV_RECORDS},
              "smem_per_block": 232448, "tmem_bytes_per_sm": 128 * 512 * 4, "degraded": {}},
    (10, 3): {"arch": "sm_103a", "kernel_target": "cuda_sm100", "mma": "tcgen05",
              "features": {"tcgen05", "tensor_memory", "fp8_block_linear", "fp4_grouped_gemm", "mxfp4_mma",
                           "paged_attention", "paged_sparse_attention", "cuda_graphs", *KV_RECORDS},
              "smem_per_block": 232448, "tmem_bytes_per_sm": 128 * 512 * 4, "degraded": {}},
    (9, 0): {"arch": "sm_90a", "kernel_target": "cuda_sm90", "mma": "wgmma",
             "features": {"fp8_block_linear", "paged_attention", "paged_sparse_attention", "cuda_graphs",
                          *KV_RECORDS},
             "smem_per_block": 232448, "tmem_bytes_per_sm": 0,
             "degraded": {
                 "fp4_grouped_gemm": "no e2m1 tensor-core MMA on SM90: tl.dot_scaled decomposes to bf16 wgmma "
                                     "(correct, ~4x the FLOP cost); feature not declared",
                 "tcgen05": "no tensor memory / tcgen05 on SM90: tl.dot lowers to wgmma with register accumulators",
                 "mxfp4_mma": "block-scaled MMA is Blackwell-only",
             }},
}

#: Peak numbers per chip, dense (no sparsity), per GPU. Sources: NVIDIA datasheets (the sparse figures
#: they print are halved to dense). B300 numbers are from NVIDIA's Blackwell Ultra announcement and
#: the HGX B300 page; check them against the datasheet of the SKU you run on (power caps vary).
CHIPS: dict[str, dict[str, Any]] = {
    "B200": {"cc": (10, 0), "memory_bytes": 180 * 10**9, "sms": 148, "bandwidth": 8.0e12,
             "flops": {"fp4_e2m1": 9.0e15, "float8_e4m3fn": 4.5e15, "bfloat16": 2.25e15, "float16": 2.25e15,
                       "tf32": 1.1e15, "float32": 75e12},
             "source": "NVIDIA HGX B200 datasheet (2025), per GPU; sparse figures halved"},
    "B300": {"cc": (10, 3), "memory_bytes": 288 * 10**9, "sms": 160, "bandwidth": 8.0e12,
             "flops": {"fp4_e2m1": 13.5e15, "float8_e4m3fn": 4.5e15, "bfloat16": 2.25e15, "float16": 2.25e15,
                       "tf32": 1.1e15, "float32": 75e12},
             "source": "NVIDIA HGX B300 page / Blackwell Ultra blog (2025), per GPU; sparse halved; GB300 "
                       "quotes 15 PFLOPS dense NVFP4 at a higher power limit"},
    "H200": {"cc": (9, 0), "memory_bytes": 141 * 10**9, "sms": 132, "bandwidth": 4.8e12,
             "flops": {"float8_e4m3fn": 1.979e15, "bfloat16": 0.989e15, "float16": 0.989e15, "tf32": 0.494e15,
                       "float32": 67e12},
             "source": "NVIDIA H200 SXM datasheet (2024); sparse figures halved"},
    # listed after B300, so identify() still maps a probed "GB300" name to the B300 row (unchanged); the
    # planner's catalog (catalog_profile) reads this row by its own name
    "GB300": {"cc": (10, 3), "memory_bytes": 288 * 10**9, "sms": 160, "bandwidth": 8.0e12,
              "flops": {"fp4_e2m1": 15.0e15, "float8_e4m3fn": 5.0e15, "bfloat16": 2.5e15, "float16": 2.5e15,
                        "tf32": 1.25e15, "float32": 80e12},
              "source": "per-GPU dense figures of GB300 (Blackwell Ultra in an NVL72 rack) as tabulated by Verda, "
                        "'NVIDIA GB300 NVL72: GPU Architecture & Performance' (verda.com/blog/gb300-nvl72-architecture; "
                        "it lists 279 GB usable of the 288 GB HBM3e NVIDIA announces: 288 recorded, as for B300); "
                        "rack totals (1.1 EF dense FP4, 576 TB/s) agree with NVIDIA's GB300 NVL72 page"},
}

#: Links per chip, per GPU and per direction (bytes/s), for the planner's EP all-to-all (``inferhal plan``):
#: ``scale_up`` reaches ``domain`` GPUs (an NVLink island: 8 in an HGX board, 72 in an NVL72 rack),
#: ``scale_out`` the rest (the GPU's own NIC). Per direction = half the bidirectional figure NVIDIA prints.
LINKS: dict[str, dict[str, Any]] = {
    "B200": {"scale_up": {"name": "NVLink 5", "bandwidth": 900e9, "domain": 8},
             "scale_out": {"name": "InfiniBand NDR (ConnectX-7, 400 Gb/s)", "bandwidth": 50e9},
             "source": "NVLink 5 1.8 TB/s per GPU bidirectional (NVIDIA; Verda's Blackwell table); one ConnectX-7 "
                       "400 Gb/s NIC per GPU as in MLPerf Inference v6.0 system descriptions of HGX B200 "
                       "(e.g. closed/Nebius/systems/nebius_b200_n1.json)"},
    "B300": {"scale_up": {"name": "NVLink 5", "bandwidth": 900e9, "domain": 8},
             "scale_out": {"name": "InfiniBand XDR (ConnectX-8, 800 Gb/s)", "bandwidth": 100e9},
             "source": "NVLink 5 2 x 900 GB/s (glennklockwood.com/garden/processors/B300); ConnectX-8 SuperNIC "
                       "800 Gb/s per GPU on HGX B300 (NVIDIA HGX B300 page) - check the NIC count of your system"},
    "GB300": {"scale_up": {"name": "NVLink 5 (NVL72 rack)", "bandwidth": 900e9, "domain": 72},
              "scale_out": {"name": "InfiniBand XDR (ConnectX-8, 800 Gb/s)", "bandwidth": 100e9},
              "source": "72-GPU NVLink domain at 1.8 TB/s per GPU bidirectional (130 TB/s per rack) and 72 ConnectX-8 "
                        "NICs per rack (NVIDIA GB300 NVL72 page, as summarised at glennklockwood.com B300 notes)"},
    "H200": {"scale_up": {"name": "NVLink 4", "bandwidth": 450e9, "domain": 8},
             "scale_out": {"name": "InfiniBand NDR (ConnectX-7, 400 Gb/s)", "bandwidth": 50e9},
             "source": "'18x 4th Gen NVLink, 900GB/s' and 400 Gb/s InfiniBand per GPU in MLPerf Inference v4.1 "
                       "closed/NVIDIA/systems/H200-SXM-141GBx8_TRT_MaxQ.json"},
}


def catalog_profile(chip: str) -> DeviceProfile:
    """The profile of a :data:`CHIPS` row without any device: what ``inferhal plan plan.device=CHIP`` plans
    with (no probe; the memory is the datasheet's, not ``cuDeviceTotalMem``). ``extra["links"]`` holds the
    chip's :data:`LINKS`. Level ``compiled``: these kernels are compiled for it here, never run on it."""
    table = CHIPS[chip]
    arch = ARCHS[table["cc"]]
    links = LINKS.get(chip, {})
    return DeviceProfile(
        backend="cuda_sm100",
        device_name=f"{chip} (datasheet)",
        torch_device="cuda",
        exec_level=ExecLevel.COMPILED,
        dtypes=DTYPES if "fp4_grouped_gemm" in arch["features"] else DTYPES - {"fp4_e2m1"},
        features=frozenset(arch["features"]),
        memory_bytes=int(table["memory_bytes"]),
        peak_bandwidth=float(table["bandwidth"]),
        peak_flops=dict(table["flops"]),
        alignment={"gemm_k": 16, "gemm_n": 16, "fp8_block": 128, "fp4_group": 32, "kv_page_bytes": 512},
        compute_units=int(table["sms"]),
        sources={"memory_bytes": table["source"], "peaks": table["source"],
                 "links": links.get("source", f"no link table for {chip}")},
        extra={"arch": arch["arch"], "chip": chip, "cc": "%d.%d" % table["cc"], "degraded": dict(arch["degraded"]),
               "links": {k: dict(v) for k, v in links.items() if k != "source"}},
    )


def catalog() -> dict[str, DeviceProfile]:
    """Every chip of :data:`CHIPS` as a :func:`catalog_profile` (the ``device_catalog`` extra)."""
    return {chip: catalog_profile(chip) for chip in CHIPS}


def identify(name: str, major: int, minor: int, memory_bytes: int) -> str | None:
    """The :data:`CHIPS` key of a probed device, or None when no table applies (peaks then stay 0)."""
    upper = name.upper()
    for chip in CHIPS:
        if chip in upper:
            return chip
    if (major, minor) == (10, 0):
        return "B200"
    if (major, minor) == (10, 3):
        return "B300"
    if (major, minor) == (9, 0) and memory_bytes > 120 * 2**30:
        return "H200"
    return None


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


def environment() -> dict[str, str]:
    """The toolchain and driver for a qualification report, without touching a device: triton and cuda-python
    from package metadata; the driver's version (cuDriverGetVersion, which needs no cuInit), or why none."""
    from inferhal.core.qualify.manifest import package_version

    env = {"triton": package_version("triton"), "cuda-python": package_version("cuda-python")}
    try:
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
        env["driver"] = (f"CUDA {int(version) // 1000}.{int(version) % 1000 // 10} ({int(version)})" if int(err) == 0
                         else f"unknown: cuDriverGetVersion returned {err}")
    except Exception as exc:  # no cuda-python, or no libcuda (DynamicLibNotFoundError, a RuntimeError)
        env["driver"] = f"absent: no CUDA driver could be loaded ({type(exc).__name__})"
    return env


def rank_index(base: int = 0) -> int:
    """The GPU of this process: ``backend.device_index`` (``base``) moved to this rank's own GPU when ranks share
    the host (``LOCAL_RANK``: :func:`inferhal.core.parallel.launch.device_index`), counted by torch
    (``CUDA_VISIBLE_DEVICES`` applies). A UserError when the host has too few GPUs for its ranks."""
    from inferhal.core.parallel.launch import device_index

    def count() -> int:
        import torch

        return torch.cuda.device_count()

    return device_index(base, count, "CUDA")


def probe(interpret: bool, index: int = 0) -> Probe:
    if interpret:
        if importlib.util.find_spec("triton") is None:
            return Probe(False, "interpret=true needs triton, which is not installed")
        return Probe(True, "Triton interpreter on the CPU (TRITON_INTERPRET=1): correctness only, not a hardware result",
                     {"exec_level": "interpreter"})
    try:
        index = rank_index(index)
    except UserError as exc:
        return Probe(False, str(exc))
    try:
        info = query_device(index)
    except RuntimeError as exc:
        return Probe(False, f"{exc} (backend.interpret=true runs the kernels in Triton's CPU interpreter)")
    if (info.major, info.minor) not in ARCHS:
        return Probe(False, f"{info.name} has compute capability {info.major}.{info.minor}; needs 10.0/10.3 "
                            f"(or 9.0, degraded)", {"device": info.name})
    import torch  # the driver sees a GPU; torch must be a CUDA build to allocate on it

    if torch.version.cuda is None:
        return Probe(False, f"{info.name} found, but torch {torch.__version__} is a CPU build: install a CUDA "
                            f"build of torch (or use backend.interpret=true)", {"device": info.name})
    level = "" if info.major == 10 else " (SM90: degraded target, see profile.extra['degraded'])"
    return Probe(True, f"{info.name}, compute capability {info.major}.{info.minor}, {info.sm_count} SMs{level}",
                 {"device": info.name, "cc": f"{info.major}.{info.minor}", "driver": info.driver_version})


def device_profile(index: int = 0) -> DeviceProfile:
    """Probe this rank's GPU (``index`` = ``backend.device_index``, moved by :func:`rank_index`) and build its
    profile from :data:`ARCHS` and :data:`CHIPS`."""
    index = rank_index(index)
    info = query_device(index)
    arch = ARCHS.get((info.major, info.minor))
    if arch is None:
        raise RuntimeError(f"{info.name}: compute capability {info.major}.{info.minor} has no capability table")
    chip = identify(info.name, info.major, info.minor, info.memory_bytes)
    table = CHIPS.get(chip, {})
    return DeviceProfile(
        backend="cuda_sm100",
        device_name=info.name,
        torch_device=f"cuda:{index}",
        exec_level=ExecLevel.DEVICE,
        dtypes=DTYPES if "fp4_grouped_gemm" in arch["features"] else DTYPES - {"fp4_e2m1"},
        features=frozenset(arch["features"]),
        memory_bytes=info.memory_bytes,
        peak_bandwidth=float(table.get("bandwidth", 0.0)),
        peak_flops=dict(table.get("flops", {})),
        alignment={"gemm_k": 16, "gemm_n": 16, "fp8_block": 128, "fp4_group": 32, "kv_page_bytes": 512},
        compute_units=info.sm_count,
        sources={"memory_bytes": "cuDeviceTotalMem", "compute_units": "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT",
                 "peaks": table.get("source", f"no peak table for {info.name}: rooflines unavailable")},
        extra={"arch": arch["arch"], "kernel_target": arch["kernel_target"], "mma": arch["mma"],
               "chip": chip or "unknown", "cc": f"{info.major}.{info.minor}", "driver": info.driver_version,
               "degraded": dict(arch["degraded"]), "smem_per_block": arch["smem_per_block"]},
    )


def interpreter_profile() -> DeviceProfile:
    return DeviceProfile(
        backend="cuda_sm100",
        device_name="Triton interpreter (CPU)",
        torch_device="cpu",
        exec_level=ExecLevel.INTERPRETER,
        dtypes=frozenset({"float32", "bfloat16", "float16", "float8_e4m3fn", "fp4_e2m1"}),
        # the interpreter computes what the kernels compute, so the numerical features hold; no
        # hardware features (tcgen05, graphs) and no roofline numbers
        features=frozenset({"fp8_block_linear", "fp4_grouped_gemm", "paged_attention", *KV_RECORDS}),
        sources={"all": "interpreter run: no device numbers apply"},
        extra={"kernel_target": "interpreter", "arch": "interpreter", "degraded": {}},
    )


# --------------------------------------------------------------------------------------------------
# Runtime device: streams, events, graphs (torch.cuda, imported on first use)
# --------------------------------------------------------------------------------------------------


class CudaDevice:
    """:class:`~inferhal.core.backend.Device` on one GPU, made this process's current GPU when constructed: the
    backend's selection builds it before any weight, KV page or process group is allocated, so everything that
    says only "cuda" (NCCL's communicator included) lands on this rank's GPU. The side stream is created on first use."""

    def __init__(self, torch_device: str) -> None:
        import torch

        self.torch_device = torch.device(torch_device)
        if self.torch_device.index is not None:
            torch.cuda.set_device(self.torch_device)
        self._side = None

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize(self.torch_device)

    def stream(self):
        import torch

        if self._side is None:
            self._side = torch.cuda.Stream(device=self.torch_device)
        return torch.cuda.stream(self._side)

    def event(self):
        import torch

        return torch.cuda.Event(enable_timing=True)

    def memory_stats(self) -> dict[str, int]:
        import torch

        free, total = torch.cuda.mem_get_info(self.torch_device)
        return {"total": int(total), "free": int(free), "allocated": int(torch.cuda.memory_allocated(self.torch_device))}

    @contextlib.contextmanager
    def forbid_host_sync(self):
        """Within it, a call that synchronises with the host raises (torch's CUDA sync debug mode): what a
        graph capture cannot contain. The device run names the first such call of a decode step."""
        import torch

        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def describe(self) -> str:
        """One line for a report: nvidia-smi's name, driver, clocks and power limit (empty without it)."""
        import subprocess

        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit",
                                  "--format=csv,noheader", f"--id={self.torch_device.index or 0}"],
                                 capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return ""
        return f"nvidia-smi: {smi.stdout.strip()}" if smi.returncode == 0 else ""


class CudaGraphRunner:
    """Captures ``fn`` for fixed-shape example args into a CUDA graph; the returned callable copies new
    inputs into the captured buffers, replays, and returns the captured outputs (valid until the next call).

    Every capture of one runner shares one memory pool (``torch.cuda.graph_pool_handle()``, as vLLM and SGLang
    share theirs across batch-size buckets): the engine replays one bucket at a time and reads its outputs
    before the next step. Wired, not yet run on a device with the pool (tests/backends/cuda_sm100 has a
    cuda-marked capture test; the device run's ``graphs`` rows measure it when a GPU is lent)."""

    def __init__(self, torch_device: str, warmup: int = 2) -> None:
        self.torch_device = torch_device
        self.warmup = warmup
        self._pool = None  # created with the first capture (importing this initialises nothing)

    def capture(self, fn: Callable[..., Any], *example_args: Any) -> Callable[..., Any]:
        import torch

        static = [a.clone() if isinstance(a, torch.Tensor) else a for a in example_args]
        side = torch.cuda.Stream(device=self.torch_device)
        side.wait_stream(torch.cuda.current_stream(self.torch_device))
        with torch.cuda.stream(side):  # warm up (Triton compiles, allocator settles) outside the graph
            for _ in range(self.warmup):
                fn(*static)
        torch.cuda.current_stream(self.torch_device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn(*static)

        def replay(*args: Any) -> Any:
            if len(args) != len(static):
                raise TypeError(f"captured with {len(static)} arguments, called with {len(args)}")
            for dst, src in zip(static, args):
                if isinstance(dst, torch.Tensor):
                    if src.shape != dst.shape:
                        raise ValueError(f"graph captured for shape {tuple(dst.shape)}, got {tuple(src.shape)}")
                    dst.copy_(src, non_blocking=True)
            graph.replay()
            return out

        return replay

