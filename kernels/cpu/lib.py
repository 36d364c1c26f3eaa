"""The CPU kernels' library: C sources compiled at run time with the system compiler, called through ctypes.

These sources (``amx_linear.c``, ``avx512_linear.c``,
``elementwise.c``, ``attention.c``, ``head_argmax.c``, with ``simd.h``) are compiled on first use with ``cc`` (``$CC``; gcc 11+ or clang 12+
know the AMX intrinsics) into one library, ``$INFERHAL_CACHE/kernels/cpu/inferhal_cpu-<digest>.so`` (default ``~/.cache/inferhal``), keyed by
the sources, the flags and the compiler's version: a changed source or compiler builds a new library, and
concurrent builders never see a half-written one (each builds to its own file, then renames). Their
OpenMP threads are the process's: torch's ``libgomp.so.1`` is already loaded, so its pool is shared.

:func:`avx512_status` says whether this process can run them, and why not: an x86-64 Linux CPU with
AVX512-BF16 (Intel Cooper Lake or Sapphire Rapids and later, AMD Zen 4 and later) and a compiler that builds
the sources (the greedy head's int8 screen also needs AVX512-VNNI, which every such CPU has: its caller checks). :func:`status` says whether it can also run the AMX product (``ih_amx_*``): a CPU with AMX-BF16
and AMX-TILE, and the kernel's permission to use AMX tile data (Linux grants it per process through
``arch_prctl``). Nothing is compiled or loaded before one of them or :func:`library` is called.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("inferhal.kernels.cpu")

SOURCES = tuple(Path(__file__).with_name(n) for n in ("amx_linear.c", "avx512_linear.c", "elementwise.c",
                                                        "attention.c", "head_argmax.c"))
HEADERS = tuple(Path(__file__).with_name(n) for n in ("simd.h",))
FLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC", "-fopenmp", "-mamx-tile", "-mamx-bf16", "-mavx512f",
         "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni")
#: /proc/cpuinfo flags every kernel's instructions need
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
#: and the AMX product's
AMX_FLAGS = ("amx_tile", "amx_bf16")
CPU_FLAGS = AMX_FLAGS + AVX512_FLAGS


@dataclass(frozen=True)
class Status:
    available: bool
    reason: str


def cache_dir() -> Path:
    return Path(os.environ.get("INFERHAL_CACHE", Path.home() / ".cache" / "inferhal")) / "kernels" / "cpu"


def _cpuinfo(field: str) -> str | None:
    """The first ``field : value`` line's value in /proc/cpuinfo (None where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


#: ``INFERHAL_MAX_CPU_ISA=AVX2`` hides this CPU's AVX-512 and AMX flags from every probe here, so a run on
#: an AVX-512 host sees what an AVX2-only host sees (cpu_amx / cpu_avx512 unavailable, with the reason);
#: with ``ONEDNN_MAX_CPU_ISA=AVX2`` and ``ATEN_CPU_CAPABILITY=avx2`` torch's kernels follow (docs/backends.md)
MAX_ISA_ENV = "INFERHAL_MAX_CPU_ISA"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's /proc/cpuinfo flags, read once (the greedy head asks at every step), less those above
    ``INFERHAL_MAX_CPU_ISA`` (``AVX2``: no avx512* / amx*; unset or ``ALL``: every flag)."""
    flags = frozenset((_cpuinfo("flags") or "").split())
    cap = os.environ.get(MAX_ISA_ENV, "").strip().upper()
    if cap in ("", "ALL"):
        return flags
    if cap == "AVX2":
        return frozenset(f for f in flags if not f.startswith(("avx512", "amx")))
    raise ValueError(f"{MAX_ISA_ENV}={cap!r}: use AVX2 (hide AVX-512 and AMX) or ALL")


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.machine()


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
    src = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    digest = hashlib.sha256(src + " ".join(FLAGS).encode() + _compiler_version(cc).encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"inferhal_cpu-{digest}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    log.info("compiling the CPU kernels with %s into %s (first use; cached after)", cc, lib)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        r = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} could not build {' + '.join(p.name for p in SOURCES)}: {r.stderr.strip()[-2000:]}")
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
    lib.ih_avx512_linear.restype = None
    lib.ih_avx512_linear.argtypes = [P, I, I, I, P, I, P, I, ctypes.c_int]
    lib.ih_q8_packed_bytes.restype = I
    lib.ih_q8_packed_bytes.argtypes = [I, I]
    lib.ih_q8_pack.restype = None
    lib.ih_q8_pack.argtypes = [P, I, P, P, I, I, I, P, P, P]
    lib.ih_q8_linear.restype = None
    lib.ih_q8_linear.argtypes = [P, I, I, I, P, P, P, I, I, P, I, ctypes.c_int]
    lib.ih_rms_norm_bf16.restype = None
    lib.ih_rms_norm_bf16.argtypes = [P, I, P, I, P, I, I, ctypes.c_float, P, I, P, I]
    lib.ih_act_gated_bf16.restype = None
    lib.ih_act_gated_bf16.argtypes = [P, I, P, I, I, I, ctypes.c_int, P, I]
    lib.ih_rope_neox_bf16.restype = I
    lib.ih_rope_neox_bf16.argtypes = [P, I, I, I, I, I, P, I, P, ctypes.c_int, P]
    lib.ih_kv_write_bf16.restype = I
    lib.ih_kv_write_bf16.argtypes = [P, I, I, I, P, P, I, I, I]
    lib.ih_head_quantize.restype = I
    lib.ih_head_quantize.argtypes = [P, I, I, I, P, P]
    lib.ih_head_rows.restype = I
    lib.ih_head_rows.argtypes = [P, I, I, I, P, P, P, P]
    lib.ih_head_argmax_i8.restype = I
    lib.ih_head_argmax_i8.argtypes = [P, P, P, P, I, I, I, P, P, P, I, I, I, P, P]
    lib.ih_attn_paged_bf16.restype = I
    lib.ih_attn_paged_bf16.argtypes = [P, I, I, I, I, I, P, I, I, I, P, I, P, I, P, I, ctypes.c_float, ctypes.c_float, P]
    return lib


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, Status]:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, Status(False, f"needs x86-64 Linux, this is {platform.system()} {platform.machine()}")
    missing = [f for f in AVX512_FLAGS if f not in cpu_flags()]
    if missing:
        return None, Status(False, f"this CPU lacks {', '.join(missing)} (AVX512-BF16 needs Intel Cooper Lake or "
                                   "Sapphire Rapids and later, or AMD Zen 4 and later)")
    cc = compiler()
    if cc is None:
        return None, Status(False, f"no C compiler: {os.environ.get('CC', 'cc')} is not on PATH (set CC)")
    try:
        lib = _bind(build(cc))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return None, Status(False, str(exc))
    return lib, Status(True, f"AVX512-BF16 on {cpu_model()}; kernels built with {cc}")


@functools.lru_cache(maxsize=1)
def _amx() -> Status:
    lib, st = _load()
    missing = [f for f in AMX_FLAGS if f not in cpu_flags()]
    if missing:  # named first: on a CPU without AMX, that is the reason, whatever else is missing
        return Status(False, f"this CPU lacks {', '.join(missing)} (AMX bf16 needs Sapphire Rapids or later)")
    if lib is None:
        return st
    rc = lib.ih_amx_init()
    if rc != 0:
        return Status(False, f"Linux refused AMX tile data to this process (arch_prctl returned {rc})")
    return Status(True, f"AMX bf16 on {cpu_model()}; kernels built with {compiler()}")


def avx512_status() -> Status:
    """Whether this process can run the AVX-512 kernels (compiles them on first call), and why not."""
    return _load()[1]


def status() -> Status:
    """Whether this process can also run the AMX product, and why not."""
    return _amx()


def clear() -> None:
    """Forget the cached load and AMX check (a test that fakes the CPU or the compiler)."""
    _amx.cache_clear()
    _load.cache_clear()


def library(amx: bool = False) -> ctypes.CDLL:
    """The loaded library; ``amx``: the caller runs ``ih_amx_*`` products (else RuntimeError says why not)."""
    lib, st = _load()
    if lib is None:
        raise RuntimeError(f"the CPU kernels are unavailable: {st.reason}")
    if amx and not _amx().available:
        raise RuntimeError(f"the AMX product is unavailable: {_amx().reason}")
    return lib
