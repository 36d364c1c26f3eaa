"""What one conformance case is, and the registry of case builders per op.

A case is one op at one shape and dtype: a deterministic input builder, a tolerance, and optional
hooks for the checks that need to know the op's structure (how to take the first ``n`` rows of a
batch; how much work it does for the roofline; which argument it writes into).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from inferhal.core.qualify.tolerances import Tolerance

Inputs = tuple[tuple, dict]  # (args, kwargs) of one call
LEVELS = ("quick", "full")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class OpCase:
    """One op at one shape and dtype.

    - ``build(seed)`` returns fresh CPU inputs, identical for equal seeds (reruns and the reference
      each get their own copy, so ops that write into an argument or draw from a generator are fair).
    - ``output(result, args, kwargs)`` picks what is compared (default: the return value); ops that
      write in place return the written argument.
    - ``rows(args, kwargs)`` / ``take(args, kwargs, n)`` / ``row_slice(out, args, kwargs, n)``: the
      batch structure for batch invariance (``None`` when the op has none).
    - ``cost(args, kwargs)`` → (FLOPs, bytes moved) for the roofline.
    - ``validate(out, ref, args, kwargs)`` → error message or "" replaces elementwise comparison where
      the reference's exact result is not the contract (e.g. random draws).
    - ``prepare(inputs, env)`` → the call's inputs, for ops whose arguments the backend under test must
      make itself (a communicator, the handle of its own ``moe.dispatch``): ``build``, ``take``, ``rows``,
      ``row_slice``, ``cost`` and ``validate`` see the built inputs; only the call (and ``output``) sees
      the prepared ones. ``env`` is a :class:`CaseEnv` of the backend whose op is called.
    """

    op_id: str
    label: str  # shape, human-readable: "T=16 D=256"
    dtype: str
    build: Callable[[int], Inputs]
    tol: Tolerance
    level: str = "quick"  # the lowest level that runs it: quick cases also run in full
    output: Callable[[Any, tuple, dict], Any] | None = None
    rows: Callable[[tuple, dict], int] | None = None
    take: Callable[[tuple, dict, int], Inputs] | None = None
    row_slice: Callable[[Any, tuple, dict, int], Any] | None = None
    cost: Callable[[tuple, dict], tuple[float, float]] | None = None
    validate: Callable[[Any, Any, tuple, dict], str] | None = None
    canon: Callable[[Any], Any] | None = None
    prepare: Callable[[Inputs, "CaseEnv"], Inputs] | None = None
    notes: str = ""

    @property
    def key(self) -> str:
        return f"{self.op_id}[{self.label} {self.dtype}]"

    def ready(self, inputs: Inputs, env: "CaseEnv | None") -> Inputs:
        """The call's inputs: ``prepare(inputs, env)`` when the case has one, else ``inputs``."""
        if self.prepare is None:
            return inputs
        if env is None:
            raise ValueError(f"case {self.key} prepares its inputs through the backend, but no CaseEnv was given")
        return self.prepare(inputs, env)

    def result(self, fn: Callable[..., Any], inputs: Inputs) -> Any:
        args, kwargs = inputs
        out = fn(*args, **kwargs)
        out = self.output(out, args, kwargs) if self.output else out
        return self.canon(out) if self.canon else out


@dataclass
class CaseEnv:
    """What a case's ``prepare`` may ask of the backend whose op it calls: another op of its table (its
    own or the reference fallback it would run with) and a single-process communicator
    (``world_size == 1``: the EP ops still run their real code paths, the collectives are identities)."""

    active: Any  # an ActiveBackend
    _comm: Any = field(default=None, repr=False)

    def op(self, op_id: str) -> Callable[..., Any]:
        return self.active.ops.entry(op_id).fn

    def communicator(self) -> Any:
        if self._comm is None:
            from inferhal.core.backend import ParallelLayout

            self._comm = self.active.communicator(ParallelLayout())
        return self._comm


# ------------------------------------------------------------------------------------------- registry

_BUILDERS: dict[str, Callable[[], list[OpCase]]] = {}


def cases_for(op_id: str) -> Callable[[Callable[[], list[OpCase]]], Callable[[], list[OpCase]]]:
    """Decorator: register the function that lists every case of ``op_id`` (both levels)."""

    def deco(fn):
        _BUILDERS[op_id] = fn
        return fn

    return deco


def registered_ops() -> list[str]:
    return list(_BUILDERS)


def op_cases(op_id: str, level: str = "full") -> list[OpCase]:
    if level not in LEVELS:
        raise ValueError(f"qualify level must be one of {', '.join(LEVELS)}, got {level!r}")
    if op_id not in _BUILDERS:
        return []
    cases = _BUILDERS[op_id]()
    return [c for c in cases if level == "full" or c.level == "quick"]


# ------------------------------------------------------------------------------------------- helpers

def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def first_rows(n: int, *tensors: torch.Tensor | None) -> list:
    return [None if t is None else t[:n] for t in tensors]


def row_dim0(out: Any, n: int) -> Any:
    """The first ``n`` rows of a tensor or of every tensor of a tuple."""
    if isinstance(out, tuple):
        return tuple(row_dim0(o, n) for o in out)
    return out[:n]


def matmul_cost(m: int, n: int, k: int, elem: int, w_elem: float | None = None) -> tuple[float, float]:
    w_elem = elem if w_elem is None else w_elem
    return 2.0 * m * n * k, m * k * elem + n * k * w_elem + m * n * elem


def nbytes(*tensors: Any) -> float:
    return float(sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)))


def to_device(obj: Any, device: str | torch.device) -> Any:
    """Move every tensor inside ``obj`` (tuples, lists, dicts, frozen dataclasses) to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: to_device(getattr(obj, f.name), device) for f in dataclasses.fields(obj)
                   if isinstance(getattr(obj, f.name), torch.Tensor)}
        return dataclasses.replace(obj, **changes) if changes else obj
    return obj


def product(*axes: Iterable) -> list[tuple]:
    import itertools

    return list(itertools.product(*axes))
