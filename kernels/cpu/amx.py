"""The AMX bf16 linear (``amx_linear.c``): compiled at run time with the system C compiler, called through ctypes.

As the CUDA C sources are compiled at run time through NVRTC, this one is compiled on first use with
``cc`` (``$CC``; gcc 11+ or clang 12+ know the AMX intrinsics) into
``$INFERHAL_CACHE/kernels/cpu/amx_linear-<digest>.so`` (default ``~/.cache/inferhal``), keyed by the
source, the flags and the compiler's version, so a changed source or compiler builds a new library and
concurrent builders never see a half-written one (each builds to its own file, then renames).

:func:`status` says whether this process can run it, and why not: an x86-64 Linux CPU with AMX-BF16,
AMX-TILE and AVX512-BF16, a compiler that builds the source, and the kernel's permission to use AMX tile
data (Linux grants it per process through ``arch_prctl``). Nothing is compiled or loaded before
:func:`status` or :func:`library` is called.

Weights are packed once into the kernel's tile layout (:func:`pack`) and kept per weight tensor, as the
reference keeps its oneDNN copies (:class:`inferhal.backends.reference.matmul.PackCache`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("amx_linear.c")
FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp", "-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bw",
         "-mavx512vl", "-mavx512bf16")
#: /proc/cpuinfo flags the kernel's instructions need
CPU_FLAGS = ("amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512vl", "avx512_bf16")
#: the reduction dimension runs in whole AMX tiles (32 bf16)
K_MULTIPLE = 32
ROW_TILE = 16


@dataclass(frozen=True)
class Status:
    available: bool
    reason: str


def cache_dir() -> Path:
    return Path(os.environ.get("INFERHAL_CACHE", Path.home() / ".cache" / "inferhal")) / "kernels" / "cpu"


def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build(cc: str, out_dir: Path | None = None) -> Path:
    """The compiled library for this source, flags and compiler, built unless cached. Raises
    RuntimeError with the compiler's message when it does not build."""
    src = SOURCE.read_bytes()
    digest = hashlib.sha256(src + " ".join(FLAGS).encode() + _compiler_version(cc).encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"amx_linear-{digest}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        r = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} could not build {SOURCE.name}: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _bind(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    P, I = ctypes.c_void_p, ctypes.c_int64
    lib.ih_amx_init.restype = ctypes.c_int
    lib.ih_amx_init.argtypes = []
    lib.ih_amx_packed_elems.restype = I
    lib.ih_amx_packed_elems.argtypes = [I, I]
    lib.ih_amx_pack.restype = None
    lib.ih_amx_pack.argtypes = [P, I, I, I, P]
    lib.ih_amx_linear.restype = None
    lib.ih_amx_linear.argtypes = [P, I, I, I, I, P, I, P, I, ctypes.c_int]
    return lib


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, Status]:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, Status(False, f"needs x86-64 Linux, this is {platform.system()} {platform.machine()}")
    missing = [f for f in CPU_FLAGS if f not in cpu_flags()]
    if missing:
        return None, Status(False, f"this CPU lacks {', '.join(missing)} (AMX bf16 needs Sapphire Rapids or later)")
    cc = compiler()
    if cc is None:
        return None, Status(False, f"no C compiler: {os.environ.get('CC', 'cc')} is not on PATH (set CC)")
    try:
        lib = _bind(build(cc))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return None, Status(False, str(exc))
    rc = lib.ih_amx_init()
    if rc != 0:
        return None, Status(False, f"Linux refused AMX tile data to this process (arch_prctl returned {rc})")
    return lib, Status(True, f"AMX bf16 on {cpu_model()}; kernel built with {cc}")


def status() -> Status:
    """Whether this process can run the kernel (compiles it on first call), and why not."""
    return _load()[1]


def library() -> ctypes.CDLL:
    lib, st = _load()
    if lib is None:
        raise RuntimeError(f"the AMX linear kernel is unavailable: {st.reason}")
    return lib


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`linear` runs ``x [.., K] . w [N, K]^T`` (else a caller uses another product)."""
    return (x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and x.device.type == "cpu"
            and w.device.type == "cpu" and w.dim() == 2 and x.dim() >= 1 and x.shape[-1] == w.shape[1]
            and w.shape[1] % K_MULTIPLE == 0 and w.shape[0] > 0 and w.stride(1) == 1)


def pack(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` bf16 (K a multiple of 32, rows contiguous) in the kernel's tile layout (N padded to 32)."""
    if not supports(w[:0, :], w):
        raise ValueError(f"pack: needs a bf16 CPU weight [N, K] with K % {K_MULTIPLE} == 0 and unit column "
                         f"stride, got {w.dtype} {tuple(w.shape)} stride {tuple(w.stride())} on {w.device}")
    lib = library()
    n, k = w.shape
    out = torch.empty(lib.ih_amx_packed_elems(n, k), dtype=torch.bfloat16)
    lib.ih_amx_pack(w.data_ptr(), n, k, w.stride(0), out.data_ptr())
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``x [..., K] . w^T`` -> ``[..., n]`` in ``out_dtype`` (bf16: fp32 sums rounded to nearest even, as
    torch casts; or fp32), from ``packed = pack(w)``. Each row's sum runs in one fixed order whatever
    the number of rows, so results are batch-invariant."""
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"linear: out_dtype must be bfloat16 or float32, got {out_dtype}")
    k = x.shape[-1]
    if packed.numel() != library().ih_amx_packed_elems(n, k):
        raise ValueError(f"linear: packed weight has {packed.numel()} elements, not a packed [{n}, {k}] weight")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=out_dtype)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    mp = -(-m // ROW_TILE) * ROW_TILE
    if mp != m or x2.stride(1) != 1:  # the kernel reads whole 16-row tiles
        x2 = F.pad(x2, (0, 0, 0, mp - m)).contiguous()
    library().ih_amx_linear(x2.data_ptr(), mp, m, k, x2.stride(0), packed.data_ptr(), n, y.data_ptr(), y.stride(0),
                            int(out_dtype == torch.float32))
    return y.reshape(*x.shape[:-1], n)
