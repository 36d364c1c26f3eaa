"""Cases of sample: greedy rows (exact) and seeded random rows (valid draws, deterministic per seed)."""

from __future__ import annotations

import torch

from inferhal.core.ops.params import SampleBatch
from inferhal.core.qualify.cases.base import OpCase, cases_for, gen, nbytes, randn
from inferhal.core.qualify.tolerances import EXACT, Tolerance


def allowed_tokens(row: torch.Tensor, temp: float, top_k: int, top_p: float) -> torch.Tensor:
    """bool [V]: the tokens a correct sampler may draw for this row's settings."""
    row = row.float() / temp
    if 0 < top_k < row.numel():
        row = row.masked_fill(row < torch.topk(row, top_k).values[-1], float("-inf"))
    probs = torch.softmax(row, dim=-1)
    sp, si = torch.sort(probs, descending=True, stable=True)
    keep = (torch.cumsum(sp, -1) - sp) <= top_p if top_p < 1.0 else sp > 0
    mask = torch.zeros_like(probs, dtype=torch.bool)
    mask[si[keep & (sp > 0)]] = True
    return mask


def _validate_draws(out, ref, args, kwargs) -> str:
    logits, p = args
    bad = []
    for i, tok in enumerate(out.tolist()):
        if p.temperature[i] <= 0:
            if tok != int(ref[i]):
                bad.append(f"row {i}: greedy token {tok} != {int(ref[i])}")
        elif not allowed_tokens(logits[i], p.temperature[i], p.top_k[i], p.top_p[i])[tok]:
            bad.append(f"row {i}: token {tok} is outside the top-k/top-p set")
    return "; ".join(bad[:4])


@cases_for("sample")
def sample() -> list[OpCase]:
    out = []
    for b, v, mode, level in [(4, 1000, "greedy", "quick"), (6, 512, "seeded", "quick"),
                              (32, 32000, "greedy", "full"), (16, 4096, "seeded", "full")]:
        def build(seed, b=b, v=v, mode=mode):
            g = gen(seed)
            logits = randn(g, b, v, scale=3.0)
            if mode == "greedy":
                p = SampleBatch(temperature=(0.0,) * b, top_k=(0,) * b, top_p=(1.0,) * b)
            else:
                temps = tuple(0.0 if i % 3 == 0 else 0.7 + 0.1 * i for i in range(b))
                p = SampleBatch(temperature=temps, top_k=tuple((0, 20, 50)[i % 3] for i in range(b)),
                                top_p=tuple((1.0, 0.9, 0.8)[i % 3] for i in range(b)),
                                generators=tuple(gen(seed * 1000 + i) for i in range(b)))
            return (logits, p), {}

        def take(a, kw, n):
            p = a[1]
            return (a[0][:n], SampleBatch(p.temperature[:n], p.top_k[:n], p.top_p[:n], p.generators[:n],
                                          p.min_p[:n])), {}

        if mode == "greedy":
            tol, validate = EXACT, None
        else:
            tol = Tolerance(exact=True, why="random rows: each token must lie in the row's top-k/top-p set (any "
                            "correct draw method passes); reruns with the same seeds must give the same tokens")
            validate = _validate_draws
        out.append(OpCase("sample", f"B={b} V={v} {mode}", "float32", build, tol, level, take=take,
                          rows=lambda a, k: a[0].shape[0], row_slice=lambda o, a, k, n: o[:n], validate=validate,
                          cost=lambda a, k: (5.0 * a[0].numel(), nbytes(a[0]))))
    return out
