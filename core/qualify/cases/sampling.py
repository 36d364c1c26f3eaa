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


@cases_for("sample.mask")
def sample_mask() -> list[OpCase]:
    out = []
    for b, v, n, level in [(4, 1000, 2, "quick"), (8, 32003, 8, "quick"), (32, 262144, 5, "full")]:
        def build(seed, b=b, v=v, n=n):
            g = gen(seed)
            words = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, (v + 31) // 32), generator=g, dtype=torch.int64)
            rows = torch.randperm(b, generator=g)[:n].long()
            return (randn(g, b, v, scale=3.0), words.to(torch.int32), rows), {}

        out.append(OpCase("sample.mask", f"B={b} V={v} rows={n}", "float32", build,
                          Tolerance(exact=True, why="a masked store of -inf: bitwise equal"), level,
                          output=lambda r, a, k: a[0], cost=lambda a, k: (0.0, 2 * nbytes(a[0]) + nbytes(a[1]))))
    return out


def _validate_verify(out, ref, args, kwargs) -> str:
    draft, _, _, p = args
    toks, n = out
    rtoks, rn = ref
    s = draft.shape[1]
    bad = []
    for r in range(draft.shape[0]):
        k = int(n[r])
        if p.temperature[r] <= 0:
            if k != int(rn[r]) or not bool((toks[r] == rtoks[r]).all()):
                bad.append(f"row {r}: greedy verify {toks[r].tolist()} != reference {rtoks[r].tolist()}")
        elif not 1 <= k <= s + 1:
            bad.append(f"row {r}: n_emitted {k} outside [1, {s + 1}]")
        elif not bool((toks[r, : k - 1] == draft[r, : k - 1]).all()) or bool((toks[r, k:] != -1).any()):
            bad.append(f"row {r}: emitted {toks[r].tolist()} is not an accepted draft prefix + one token, -1 padded")
    return "; ".join(bad[:4])


@cases_for("spec.verify")
def spec_verify() -> list[OpCase]:
    out = []
    for b, s, v, mode, level in [(4, 3, 64, "greedy", "quick"), (5, 3, 128, "seeded", "quick"),
                                 (16, 4, 1024, "greedy", "full"), (8, 5, 512, "seeded", "full")]:
        def build(seed, b=b, s=s, v=v, mode=mode):
            g = gen(seed)
            logits = randn(g, b, s + 1, v, scale=3.0)
            draft = torch.randint(0, v, (b, s), generator=g)
            agree = torch.randint(0, s + 1, (b,), generator=g)  # row r agrees with the target for agree[r] steps
            for r in range(b):
                draft[r, : int(agree[r])] = logits[r, : int(agree[r])].argmax(-1)
            if mode == "greedy":
                p = SampleBatch(temperature=(0.0,) * b, top_k=(0,) * b, top_p=(1.0,) * b)
                probs = None
            else:
                p = SampleBatch(temperature=tuple(0.0 if r == 0 else 0.8 for r in range(b)), top_k=(0,) * b,
                                top_p=(1.0,) * b, generators=tuple(gen(seed * 1000 + r) for r in range(b)))
                probs = torch.softmax(randn(g, b, s, v), dim=-1)
            return (draft, probs, logits, p), {}

        def take(a, kw, n):
            d, q, lg, p = a
            return (d[:n], None if q is None else q[:n], lg[:n],
                    SampleBatch(p.temperature[:n], p.top_k[:n], p.top_p[:n], p.generators[:n], p.min_p[:n])), {}

        tol = EXACT if mode == "greedy" else Tolerance(exact=True, why="random rows: an accepted draft prefix plus "
                                                       "one token, -1 padded; greedy rows equal the reference")
        out.append(OpCase("spec.verify", f"B={b} S={s} V={v} {mode}", "float32", build, tol, level, take=take,
                          rows=lambda a, k: a[0].shape[0], row_slice=lambda o, a, k, n: (o[0][:n], o[1][:n]),
                          validate=None if mode == "greedy" else _validate_verify,
                          cost=lambda a, k: (5.0 * a[2].numel(), nbytes(a[2]))))
    return out
