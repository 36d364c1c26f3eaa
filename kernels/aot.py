"""Ahead-of-time compilation of every kernel for a GPU architecture, without a GPU.

``compile_all("sm_100a")`` runs Triton's compiler (``triton.compile(ASTSource(...),
target=GPUTarget("cuda", 100, 32))``, bundled ptxas) on each :data:`~inferhal.kernels.registry.KERNELS`
spec and reports, per kernel: compiled or not (with the error), registers and spills (from the cubin,
via the bundled ``cuobjdump -res-usage``; where there is a stack, its local loads and stores in the SASS), shared and tensor memory (from Triton's metadata), and the
MMA instructions in the PTX (``tcgen05.mma`` kinds on SM100, ``wgmma`` on SM90). Nothing here runs a
kernel: every result's execution level is ``compiled``.

A spec with ``values`` (its integer arguments at production shapes) is compiled as Triton's JIT specialises
a launch (unit integers as constexprs, multiples of 16 and pointers marked divisible by 16: unit strides and
aligned rows let loads vectorise, which changes registers and spills); the others see every integer as an
unknown i32 (``specialized`` in the row says which).

Must run in a process whose kernels are *not* interpreted (TRITON_INTERPRET unset): ASTSource needs
JIT functions. :func:`compile_all` switches the mode and raises if kernel modules were already
imported in interpreter mode.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from typing import Any

#: arch name -> (GPUTarget arch number, tuning target, MMA instruction the tensor-core kernels must use)
ARCHS: dict[str, tuple[int, str, str]] = {
    "sm_100a": (100, "cuda_sm100", "tcgen05.mma"),
    "sm_103a": (103, "cuda_sm100", "tcgen05.mma"),
    "sm_90a": (90, "cuda_sm90", "wgmma"),
}


def _cuobjdump(cubin: bytes, flag: str, timeout: int) -> str | None:
    """``cuobjdump FLAG`` of a cubin (Triton ships cuobjdump), or None where the tool is missing or fails."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool) or not cubin:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            return subprocess.run([tool, flag, f.name], capture_output=True, text=True, timeout=timeout).stdout
        except (OSError, subprocess.SubprocessError):
            return None


def _resource_usage(cubin: bytes, kernel: str) -> dict[str, int]:
    """REG / STACK / SHARED / LOCAL of ``kernel`` from ``cuobjdump -res-usage``."""
    out: dict[str, int] = {}
    for line in (_cuobjdump(cubin, "-res-usage", 60) or "").splitlines():
        if "REG:" in line:
            for key, val in re.findall(r"(\w+(?:\[\d+\])?):(\d+)", line):
                out[key] = int(val)
    return out


def _local_ops(cubin: bytes) -> tuple[int, int] | tuple[None, None]:
    """(local loads, local stores) in the kernel's SASS (``LDL`` / ``STL`` from ``cuobjdump -sass``): the traffic a
    spill stack costs. A stack with none is a frame ptxas reserved and the code never touches (Triton's FP4
    kernels declare a 1-2 byte local depot in their PTX and report 8 B of stack)."""
    sass = _cuobjdump(cubin, "-sass", 120)
    if sass is None:
        return None, None
    return len(re.findall(r"\bLDL\b", sass)), len(re.findall(r"\bSTL\b", sass))


def _mma_kinds(ptx: str) -> list[str]:
    kinds = sorted(set(re.findall(r"tcgen05\.mma[\w.:]*?kind::(\w+)", ptx)))
    return kinds


def compile_one(spec, arch: str) -> dict[str, Any]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from inferhal.kernels.tuning import config, launch_options

    cap, tuning_target, mma_instr = ARCHS[arch]
    cfg = config(spec.tuning, tuning_target)
    row: dict[str, Any] = {"kernel": spec.name, "op": spec.op_id, "arch": arch, "tuning": tuning_target,
                           "execution_level": "compiled", "mma_required": spec.mma, "config": dict(cfg),
                           "specialized": spec.values is not None}
    t0 = time.perf_counter()
    try:
        fn = spec.load()
        cx, attrs = spec.specialization(fn, spec.constexprs(cfg))
        src = ASTSource(fn=fn, signature=spec.signature(fn, cx), constexprs=cx, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", cap, 32), options=launch_options(cfg))
    except Exception as exc:  # a kernel that does not compile is a result, not a crash of the report
        msg = " ".join(str(exc).split())
        row.update(compiled=False, error=f"{type(exc).__name__}: {msg[:600]}", seconds=round(time.perf_counter() - t0, 2))
        return row
    ptx = k.asm.get("ptx", "")
    res = _resource_usage(k.asm.get("cubin", b""), k.metadata.name)
    loads, stores = _local_ops(k.asm.get("cubin", b"")) if res.get("STACK") else (0, 0)
    row.update(
        compiled=True, error="", seconds=round(time.perf_counter() - t0, 2),
        registers=res.get("REG"), spill_stack_bytes=res.get("STACK"), local_bytes=res.get("LOCAL"),
        local_loads=loads, local_stores=stores,
        shared_bytes=int(k.metadata.shared), tmem_columns=int(getattr(k.metadata, "tmem_size", 0) or 0),
        num_warps=k.metadata.num_warps, num_stages=k.metadata.num_stages,
        tcgen05="tcgen05.mma" in ptx, tcgen05_kinds=_mma_kinds(ptx), wgmma="wgmma.mma_async" in ptx,
        mma_sync="mma.sync" in ptx, ptx_bytes=len(ptx), cubin_bytes=len(k.asm.get("cubin", b"")),
    )
    row["mma_ok"] = (not spec.mma) or (mma_instr in ptx)
    # the one description core prints (core knows no instruction names)
    row["mma"] = (("tcgen05 " + "/".join(row["tcgen05_kinds"])) if row["tcgen05"] else
                  "wgmma" if row["wgmma"] else "mma.sync" if row["mma_sync"] else "-")
    return row


def compile_all(arch: str, names: list[str] | None = None) -> list[dict[str, Any]]:
    if arch not in ARCHS:
        raise ValueError(f"unknown target {arch!r}; known: {', '.join(ARCHS)}")
    from inferhal.kernels.runtime import use_interpreter

    use_interpreter(False)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # keep 3.9's default, silence its warning
    from inferhal.kernels.registry import KERNELS

    return [compile_one(s, arch) for s in KERNELS if names is None or s.name in names]


class AotCompiler:
    """What the backend hands ``inferhal kernels compile`` through its ``aot_compiler`` extra."""

    targets = tuple(ARCHS)

    def compile(self, target: str, names: list[str] | None = None) -> list[dict[str, Any]]:
        return compile_all(target, names)
