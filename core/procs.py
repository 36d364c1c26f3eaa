"""How inferhal starts its worker processes: DP and EP ranks, prefill/decode instances, the bench's server children.

Every such process comes from :func:`context` (or :func:`method` + :func:`entry` for
``torch.multiprocessing.start_processes``). The default start method is **forkserver with torch preloaded**: the
first process a parent starts also starts a small server process that imports torch once (about 1.5 s of CPU);
every process after that is forked from it with torch already imported, where ``spawn`` paid the import in each
one. A DP group's restart after a rank's death, a bench's servers and the EP launcher's ranks start that much
sooner. ``spawn`` stays available: ``INFERHAL_WORKER_MULTIPROC_METHOD=spawn`` (vLLM's knob of the same kind is
``VLLM_WORKER_MULTIPROC_METHOD``); any other value is refused naming the variable.

Only torch is preloaded, never inferhal or the kernel compiler: their modules read the environment when imported
(the kernel interpreter's switch is read when a kernel is decorated), and a forkserver keeps the environment it
started with. For the same reason every target runs under :func:`_with_env`, which gives the child the caller's
``os.environ`` as it was at ``start()``, and torch's intra-op thread count from its ``OMP_NUM_THREADS``, as a
spawned child had them. Nothing else differs from ``spawn``: targets and arguments are pickled, the child prepares
``sys.path``, the working directory and ``__main__`` as a spawned one does; torch initialises no accelerator in the
server, so a child that uses one starts clean. Where the platform has no forkserver, processes are spawned.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
from typing import Any, Callable

from inferhal.core.errors import UserError

METHOD_ENV = "INFERHAL_WORKER_MULTIPROC_METHOD"
METHODS = ("forkserver", "spawn")
PRELOAD = ("torch",)


def method() -> str:
    """The start method: ``$INFERHAL_WORKER_MULTIPROC_METHOD`` (forkserver by default), spawn where the platform
    has no forkserver. Raises a :class:`UserError` naming the variable for another value."""
    want = os.environ.get(METHOD_ENV, "").strip() or "forkserver"
    if want not in METHODS:
        raise UserError(f"{METHOD_ENV}={want!r}: must be one of {', '.join(METHODS)}")
    if want == "forkserver":
        if "forkserver" not in multiprocessing.get_all_start_methods():
            return "spawn"
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))  # read at its first start
    return want


class Context:
    """A ``multiprocessing`` context whose ``Process`` runs its target under the caller's environment (module
    docstring); everything else (``Pipe``, ``Queue``, ...) is the context's own."""

    def __init__(self, name: str) -> None:
        self._ctx = multiprocessing.get_context(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def Process(self, target: Callable[..., Any], args: tuple = (), kwargs: dict | None = None,  # noqa: N802
                **options: Any) -> Any:
        return self._ctx.Process(target=_with_env, args=(dict(os.environ), target, tuple(args), dict(kwargs or {})),
                                 **options)


def context() -> Context:
    """The context worker processes start from (:func:`method`)."""
    return Context(method())


def entry(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` for ``torch.multiprocessing.start_processes(..., start_method=method())``: called as ``fn(index,
    *args)`` in the child, under the caller's environment as it is now."""
    return functools.partial(_indexed, dict(os.environ), fn)


def _adopt(env: dict) -> None:
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")  # preloaded in a forkserver's child; a spawned one reads the env itself
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _with_env(env: dict, target: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    _adopt(env)
    return target(*args, **kwargs)


def _indexed(env: dict, fn: Callable[..., Any], index: int, *args: Any) -> Any:
    _adopt(env)
    return fn(index, *args)
