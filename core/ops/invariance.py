"""Batch invariance as capability data: what each op of a backend declares, and what the registry makes of it.

An op is *batch invariant* when a row's result is bitwise the same whatever other rows share its call (batch
size, the other requests, their chunking): fixed tiles and a fixed reduction order per row, no split chosen
from the token count. ``deterministic=true`` (and ``backend.batch_invariant=true``) needs every op that runs
to be so. A backend states it per op through ``inferhal_op_batch_invariance`` (see
:mod:`inferhal.core.hookspecs`); the registry refuses the mode naming each op that does not declare it, with
the op's own reason.

>>> BatchInvariance(True, "one program per row, the whole row in one block")
>>> BatchInvariance(True, "products over fixed 16-row tiles", mode_only=True)  # only with batch_invariant=true
>>> BatchInvariance(False, "oneDNN picks its blocking from the number of rows")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from inferhal.core.ops.vocabulary import check_op_id


@dataclass(frozen=True)
class BatchInvariance:
    """One op's declaration. ``why``: how invariance holds (fixed tiles, row loop, ...) or what breaks it;
    it is shown by ``inferhal backends`` and in refusals, so write it for a user. ``mode_only``: the op is
    invariant only when the backend is selected with ``backend.batch_invariant=true`` (it then runs another
    implementation, e.g. the reference's fixed row tiles); otherwise it always is."""

    invariant: bool
    why: str
    mode_only: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.invariant, bool):
            raise TypeError(f"BatchInvariance.invariant must be a bool, got {self.invariant!r}")
        if not self.why:
            raise ValueError("BatchInvariance needs a reason (how invariance holds, or what breaks it)")
        if self.mode_only and not self.invariant:
            raise ValueError("BatchInvariance: mode_only applies to an invariant op only")

    @property
    def state(self) -> str:
        """``always`` / ``in mode`` / ``no``: one word for tables."""
        return "no" if not self.invariant else "in mode" if self.mode_only else "always"

    def holds(self, mode_on: bool) -> bool:
        """Whether a row's result is batch invariant with the backend's batch-invariant mode on or off."""
        return self.invariant and (mode_on or not self.mode_only)


def check_declarations(backend: str, declared: Any) -> dict[str, BatchInvariance]:
    """Validate what a backend's ``inferhal_op_batch_invariance`` returned → op ID → declaration."""
    if not isinstance(declared, Mapping):
        raise TypeError(f"backend {backend!r}: inferhal_op_batch_invariance returned {type(declared).__name__}, "
                        f"not a mapping of op ID to BatchInvariance")
    out = {}
    for op_id, d in declared.items():
        check_op_id(op_id)
        if not isinstance(d, BatchInvariance):
            raise TypeError(f"backend {backend!r}: the batch-invariance declaration of {op_id!r} is "
                            f"{type(d).__name__}, not a BatchInvariance")
        out[op_id] = d
    return out


UNDECLARED = BatchInvariance(False, "the backend declares no batch invariance for this op")
