"""Comparing an op's result with the reference's: error statistics, a tolerance verdict, bitwise equality.

Results may be a tensor, a tuple of tensors (compared component-wise), or None. Integer and bool
components must match exactly whatever the case's tolerance says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from inferhal.core.qualify.tolerances import Tolerance

#: error histogram bins: exact, then decades of |y - r| / rms(r) from 1e-9 to >= 1
HIST_EDGES = [-9, -8, -7, -6, -5, -4, -3, -2, -1, 0]
HIST_LABELS = ["0"] + [f"<1e{e}" for e in HIST_EDGES] + [">=1"]


@dataclass
class ErrorStats:
    ok: bool
    max_abs: float = 0.0
    max_rel: float = 0.0
    cosine: float = 1.0
    n: int = 0
    n_bad: int = 0
    message: str = ""
    hist: list[int] = field(default_factory=lambda: [0] * len(HIST_LABELS))

    def to_dict(self) -> dict:
        return {"ok": self.ok, "max_abs": self.max_abs, "max_rel": self.max_rel, "cosine": self.cosine,
                "n": self.n, "n_bad": self.n_bad, "message": self.message, "hist": self.hist}


def _parts(x: Any) -> list:
    return list(x) if isinstance(x, (tuple, list)) else [x]


def histogram(err_over_scale: torch.Tensor) -> list[int]:
    e = err_over_scale.flatten().double()
    zero = int((e == 0).sum())
    nz = e[e > 0]
    logs = torch.log10(nz) if nz.numel() else nz
    counts = [zero]
    lo = -math.inf
    for edge in HIST_EDGES:
        counts.append(int(((logs >= lo) & (logs < edge)).sum()))
        lo = edge
    counts.append(int((logs >= lo).sum()))
    return counts


def compare(out: Any, ref: Any, tol: Tolerance) -> ErrorStats:
    """Elementwise ``|y - r| <= rtol |r| + atol rms(r)`` plus the cosine floor, over every component."""
    outs, refs = _parts(out), _parts(ref)
    if len(outs) != len(refs):
        return ErrorStats(False, message=f"returned {len(outs)} value(s), the reference returns {len(refs)}")
    stats = ErrorStats(True)
    dots = [0.0, 0.0, 0.0]  # y.r, y.y, r.r over float components
    for i, (y, r) in enumerate(zip(outs, refs)):
        where = f"output {i}: " if len(outs) > 1 else ""
        if r is None or y is None:
            if (r is None) != (y is None):
                return ErrorStats(False, message=f"{where}returned {type(y).__name__}, the reference {type(r).__name__}")
            continue
        if not isinstance(y, torch.Tensor):
            return ErrorStats(False, message=f"{where}returned {type(y).__name__}, expected a tensor")
        if tuple(y.shape) != tuple(r.shape):
            return ErrorStats(False, message=f"{where}shape {tuple(y.shape)} != reference {tuple(r.shape)}")
        y, r = y.detach().cpu(), r.detach().cpu()
        exact = tol.exact or not (r.is_floating_point() or r.is_complex())
        if y.dtype != r.dtype and (exact or not y.is_floating_point()):
            return ErrorStats(False, message=f"{where}dtype {y.dtype} != reference {r.dtype}")
        yf, rf = y.double(), r.double()
        if not bool(torch.isfinite(yf).all()) and bool(torch.isfinite(rf).all()):
            stats.ok = False
            stats.message = stats.message or f"{where}{int((~torch.isfinite(yf)).sum())} non-finite values"
            yf = torch.nan_to_num(yf, nan=1e30, posinf=1e30, neginf=-1e30)
        err = (yf - rf).abs()
        scale = float(rf.pow(2).mean().sqrt()) if rf.numel() else 0.0
        scale = scale if scale > 0 else 1.0
        stats.n += err.numel()
        if err.numel():
            stats.max_abs = max(stats.max_abs, float(err.max()))
            stats.max_rel = max(stats.max_rel, float((err / rf.abs().clamp(min=scale * 1e-3)).max()))
            stats.hist = [a + b for a, b in zip(stats.hist, histogram(err / scale))]
        bad = err > 0 if exact else err > tol.rtol * rf.abs() + tol.atol * scale
        nb = int(bad.sum())
        if nb:
            stats.ok = False
            stats.n_bad += nb
            idx = tuple(int(j) for j in torch.nonzero(bad)[0])
            stats.message = stats.message or (f"{where}{nb} of {err.numel()} elements out of tolerance; first at "
                                              f"{list(idx)}: got {float(yf[idx]):.6g}, reference {float(rf[idx]):.6g}")
        if not exact:
            dots[0] += float((yf * rf).sum())
            dots[1] += float((yf * yf).sum())
            dots[2] += float((rf * rf).sum())
    if dots[1] > 0 and dots[2] > 0:
        stats.cosine = dots[0] / math.sqrt(dots[1] * dots[2])
        if stats.cosine < tol.min_cosine:
            stats.ok = False
            stats.message = stats.message or f"cosine {stats.cosine:.8f} < {tol.min_cosine:.8f}"
    return stats


def bitwise_equal(a: Any, b: Any) -> tuple[bool, str]:
    """Exact equality including NaN payloads and signed zeros; → (equal, where they differ)."""
    pa, pb = _parts(a), _parts(b)
    if len(pa) != len(pb):
        return False, f"{len(pa)} vs {len(pb)} outputs"
    for i, (x, y) in enumerate(zip(pa, pb)):
        if x is None or y is None:
            if (x is None) != (y is None):
                return False, f"output {i}: None vs tensor"
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            return False, f"output {i}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}"
        xb, yb = _bits(x.detach().cpu()), _bits(y.detach().cpu())
        diff = xb != yb
        if bool(diff.any()):
            idx = [int(j) for j in torch.nonzero(diff)[0]]
            return False, f"output {i}: {int(diff.sum())} elements differ, first at {idx}"
    return True, ""


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.is_floating_point() and t.element_size() in (1, 2, 4, 8):
        return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t
