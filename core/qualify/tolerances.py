"""Numerical tolerances per dtype, each derived from the dtype's unit roundoff so it can be explained.

A result ``y`` passes against the reference ``r`` when, elementwise,
``|y - r| <= rtol * |r| + atol * rms(r)`` and ``cosine(y, r) >= 1 - (atol)^2 / 2``.
``rtol`` and ``atol`` are multiples (``ulps``) of the unit roundoff ``u = 2^-(mantissa bits + 1)``:
one rounding of the output costs at most one ``u`` relative; a kernel that rounds an intermediate
differently, or accumulates a K-long fp32 sum in another order, costs a few more. ``atol`` is scaled
by the reference's RMS so it measures error against the output's own scale (outputs near zero
would otherwise need an arbitrary absolute floor). The cosine bound follows from
``1 - cos = |e|^2 / (2 |r|^2)`` for an error ``e``: it allows an RMS relative error of ``atol``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: unit roundoff 2^-(p) with p = stored mantissa bits + 1 (round to nearest).
UNIT_ROUNDOFF = {
    "float32": 2.0**-24,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
    "float8_e4m3fn": 2.0**-4,
    "float8_e5m2": 2.0**-3,
    "fp4_e2m1": 2.0**-2,
}


@dataclass(frozen=True)
class Tolerance:
    """Elementwise bound plus a cosine floor; ``exact`` demands bitwise-equal results (integer outputs)."""

    rtol: float = 0.0
    atol: float = 0.0  # in units of rms(reference)
    exact: bool = False
    why: str = ""

    @property
    def min_cosine(self) -> float:
        return 1.0 if self.exact else 1.0 - max(self.atol, self.rtol) ** 2 / 2.0

    def to_dict(self) -> dict:
        return {"rtol": self.rtol, "atol_rms": self.atol, "min_cosine": self.min_cosine, "exact": self.exact,
                "why": self.why}


EXACT = Tolerance(exact=True, why="integer or selection output: must match the reference exactly")


def ulps(dtype: str, n: float, why: str, floor_dtype: str = "float32") -> Tolerance:
    """``n`` units of roundoff of ``dtype`` (never tighter than ``n`` ulps of ``floor_dtype``, the accumulator).

    fp32 results still pay for fp32 accumulation in a different order, so fp32 tolerances are ``n`` ulps
    times a reduction-length factor chosen by the case (passed in ``n``).
    """
    u = max(UNIT_ROUNDOFF[dtype], UNIT_ROUNDOFF[floor_dtype])
    return Tolerance(rtol=n * u, atol=n * u, why=f"{n:g} x u({dtype}) = {n * u:.3g}: {why}")
