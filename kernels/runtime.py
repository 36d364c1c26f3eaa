"""The interpreter switch and the one dtype switch every kernel shares.

Triton decides at *definition* time whether ``@triton.jit`` builds an interpreted function: the
environment variable ``TRITON_INTERPRET=1`` must be set before any kernel module of this package is
imported. :func:`use_interpreter` sets it and refuses when kernel modules were already imported in
the other mode (a silent mix would run "interpreter" tests on compiled functions or vice versa).

``DOT_UPCAST`` is the single place where the interpreter's bf16 ``tl.dot`` bug (triton-lang/triton
#11584: it multiplies raw bf16 bit patterns) is worked around: kernels take a ``UPCAST: tl.constexpr``
argument, and the wrappers pass ``DOT_UPCAST``. Under the interpreter bf16 operands are upcast to fp32
before ``tl.dot``; compiled kernels (AOT or on a device) keep bf16 operands and use the tensor cores.
"""

from __future__ import annotations

import os
import sys

ENV = "TRITON_INTERPRET"

#: modules whose import defines @triton.jit functions (each kernel module imports this one first)
_KERNEL_MODULE_PREFIX = "inferhal.kernels."
_NON_KERNEL = {"inferhal.kernels.runtime", "inferhal.kernels.tuning", "inferhal.kernels.registry",
               "inferhal.kernels.aot",
               "inferhal.kernels.cpu", "inferhal.kernels.cpu.amx"}  # C kernels: no Triton mode


def interpreting() -> bool:
    """True when kernels are (or will be) defined as interpreted functions."""
    return os.environ.get(ENV, "0") not in ("", "0")


def imported_kernel_modules() -> list[str]:
    return sorted(m for m in sys.modules if m.startswith(_KERNEL_MODULE_PREFIX) and m not in _NON_KERNEL)


def language_mode() -> bool | None:
    """How ``triton.language`` defined its own ``@triton.jit`` helpers (``tl.sum``, ``tl.max``, ...) when it was
    imported: interpreted (True) or compiled (False); None before its import (or a Triton with neither kind).
    Fixed then, as for every ``@triton.jit``: something that imports triton before :func:`use_interpreter` (a torch
    dispatch mode does, e.g. core's host-read guard) fixes it for the whole process."""
    tl = sys.modules.get("triton.language")
    kind = type(getattr(getattr(tl, "standard", None), "sum", None)).__name__
    return {"InterpretedFunction": True, "JITFunction": False}.get(kind)


def use_interpreter(enabled: bool) -> None:
    """Select the execution mode of this process's kernels; call before importing any kernel module.

    Raises RuntimeError when kernel modules, or triton.language's own helpers, are already defined in the other
    mode (interpreted kernels calling compiled ``tl.sum`` fail with "Cannot call @triton.jit'd outside of the scope
    of a kernel", naming neither cause).
    """
    lang = language_mode()
    if lang is not None and lang != enabled:
        have, want = ("interpreted", "compiled") if lang else ("compiled", "interpreted")
        raise RuntimeError(
            f"cannot run Triton kernels {want}: triton.language was imported before with its own helpers "
            f"(tl.sum, tl.max, ...) {have}; set {ENV}={'1' if enabled else '0'} before anything imports triton "
            f"(a torch dispatch mode or torch.compile may), or start a new process"
        )
    if enabled == interpreting():
        if enabled:
            os.environ[ENV] = "1"
            _lighter_device_calls()
        return
    loaded = imported_kernel_modules()
    if loaded:
        want = "interpreter" if enabled else "compiled"
        raise RuntimeError(
            f"cannot switch Triton kernels to {want} mode: {', '.join(loaded)} were already imported with "
            f"{ENV}={os.environ.get(ENV, '<unset>')}; start a new process (or set {ENV} before importing inferhal.kernels)"
        )
    if enabled:
        os.environ[ENV] = "1"
        _lighter_device_calls()
    else:
        os.environ.pop(ENV, None)


# Fixed at import of the first kernel module; kernels read it only through their UPCAST constexpr.
DOT_UPCAST: bool = interpreting()


def dot_upcast() -> bool:
    """The value kernels get for ``UPCAST`` (re-read, so a process that switched before importing agrees)."""
    return interpreting()


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _lighter_device_calls() -> None:
    """Triton's interpreter (3.x) patches ``triton.language`` for a kernel's whole grid when the kernel starts, and
    again at every call of a ``@triton.jit`` helper from inside it (``inspect.getmembers`` over the language
    modules, per helper call per program), though nothing changed: py-spy on a whole suite run put 29 % of the
    interpreter's time there. While a kernel's grid runs, a helper that sees no language module the kernel did
    not is called without the repeat; it runs the same rewritten function either way. Triton's own helpers
    (``tl.sum``, ``tl.zeros``, ``tl.max``: triton.language.standard) see ``triton.language.core`` where kernels see
    ``triton.language``: the first such call in a grid patches it as Triton does (a helper call's patches are never
    restored, so they hold for the rest of the grid) and later ones skip the repeat; before this, 6,028 of a tiny
    DeepSeek-V4 step's helper calls (``tl.sum`` alone) still re-patched, 30 % of its interpreted time (cProfile).
    A Triton without these internals keeps its own behaviour."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti

        grid_call, device_call = ti.GridExecutor.__call__, ti.InterpretedFunction.__call__
        error = ti.InterpreterError
    except (ImportError, AttributeError):
        return
    if getattr(device_call, "_inferhal_lighter", False):
        return
    seen: dict = {}
    active: list = []

    def langs(fn) -> frozenset:
        got = seen.get(fn)
        if got is None:  # the modules _patch_lang patches for fn
            got = seen[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        return got

    def run_grid(self, *args, **kwargs):
        active.append(set(langs(self.fn)))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            active.pop()

    def call(self, *args, **kwargs):
        if not active:
            return device_call(self, *args, **kwargs)
        need = langs(self.fn)
        if not need <= active[-1]:  # e.g. tl.sum: triton.language.standard sees tl.core, the kernel tl
            out = device_call(self, *args, **kwargs)  # patches them; nothing restores them while the grid runs
            active[-1].update(need)
            return out
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as the interpreter's own call says it
            raise error(repr(e)) from e

    call._inferhal_lighter = True
    ti.GridExecutor.__call__, ti.InterpretedFunction.__call__ = run_grid, call


if interpreting():
    _lighter_device_calls()
