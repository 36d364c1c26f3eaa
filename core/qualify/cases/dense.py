"""Cases of the dense ops: norm.rms, rope.apply, linear (plain, fp8_block, fp4_group, int_block), lm_head,
lm_head.argmax, act.gated, embed, topk.select."""

from __future__ import annotations

import math

import torch

from inferhal.core.ops.params import ActParams, RmsNormParams, RopeParams
from inferhal.core.ops.quantize import quantize_fp4_group, quantize_fp8_block, quantize_int_block
from inferhal.core.qualify.cases.base import (DTYPES, OpCase, cases_for, gen, matmul_cost, nbytes,
                                              randn, row_dim0)
from inferhal.core.qualify.tolerances import EXACT, ulps

_ROWS0 = dict(rows=lambda a, k: a[0].shape[0], row_slice=lambda out, a, k, n: row_dim0(out, n))


def _dtypes(level: str) -> tuple[str, ...]:
    """The activation dtypes a sweep entry runs in: fp16 only at the full level."""
    return ("float32", "bfloat16") if level == "quick" else ("float32", "bfloat16", "float16")


def _elem(dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


# ------------------------------------------------------------------------------------------- norm.rms

@cases_for("norm.rms")
def norm_rms() -> list[OpCase]:
    out = []
    sweep = [(16, 256, False, False, "quick"), (7, 640, True, True, "quick"), (1, 64, False, True, "full"),
             (33, 1024, True, False, "full"), (128, 4096, False, True, "full")]
    for t, d, unit, resid, level in sweep:
        for dtype in _dtypes(level):
            def build(seed, t=t, d=d, unit=unit, resid=resid, dtype=dtype):
                g = gen(seed)
                dt = DTYPES[dtype]
                x = randn(g, t, d, dtype=dt, scale=3.0)
                w = randn(g, d, dtype=dt, scale=0.5) + (0 if unit else 1)
                r = randn(g, t, d, dtype=dt) if resid else None
                kw = {"residual": r} if resid else {}
                return (x, w, RmsNormParams(eps=1e-6, unit_offset=unit)), kw

            def take(a, k, n):
                x, w, p = a
                return (x[:n], w, p), {kk: v[:n] for kk, v in k.items()}

            n = 2 if dtype == "float32" else 4
            tol = ulps(dtype, n if dtype != "float32" else 16,
                       "one rounding of the output, one of the fused residual sum, truncating emulator stores;"
                       " fp32: the mean of squares summed in another order")
            label = f"T={t} D={d}" + (" unit_offset" if unit else "") + (" +residual" if resid else "")
            out.append(OpCase("norm.rms", label, dtype, build, tol, level, take=take, **_ROWS0,
                              cost=lambda a, k: (4.0 * a[0].numel(), nbytes(a[0], a[1], *k.values()) * 2)))
    return out


# ------------------------------------------------------------------------------------------- rope.apply

def cos_sin_table(positions: int, rotary: int, theta: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat((ang.cos(), ang.sin()), dim=-1).float()  # [P, R]


@cases_for("rope.apply")
def rope_apply() -> list[OpCase]:
    out = []
    sweep = [(9, 4, 64, 64, "neox", "head", False, "quick"), (5, 2, 128, 64, "interleaved", "tail", True, "quick"),
             (32, 8, 128, 128, "neox", "head", False, "full"), (17, 1, 512, 64, "interleaved", "tail", False, "full"),
             (3, 4, 256, 32, "neox", "tail", True, "full")]
    for t, h, d, r, style, place, inv, level in sweep:
        for dtype in _dtypes(level):
            def build(seed, t=t, h=h, d=d, r=r, style=style, place=place, inv=inv, dtype=dtype):
                g = gen(seed)
                x = randn(g, t, h, d, dtype=DTYPES[dtype])
                pos = torch.randint(0, 4096, (t,), generator=g, dtype=torch.long)
                return (x, pos, cos_sin_table(4096, r), RopeParams(r, style, place, inv)), {}

            def take(a, k, n):
                return (a[0][:n], a[1][:n], a[2], a[3]), {}

            label = f"T={t} H={h} D={d} R={r} {style} {place}" + (" inverse" if inv else "")
            tol = ulps(dtype, 2 if dtype != "float32" else 8, "one rotation (two products and a sum) and one rounding")
            out.append(OpCase("rope.apply", label, dtype, build, tol, level, take=take, **_ROWS0,
                              cost=lambda a, k: (3.0 * a[0].numel(), 2 * nbytes(a[0]))))
    return out


# ------------------------------------------------------------------------------------------- linear

def _weight(g: torch.Generator, n: int, k: int, dtype: str, fmt: str):
    """A ``[n, k]`` weight of scale 1/sqrt(k): plain in ``dtype``, or quantised to ``fmt``."""
    return _weight_of(randn(g, n, k, scale=k ** -0.5), fmt, dtype)


def _weight_of(w: torch.Tensor, fmt: str, dtype: str):
    """fp32 ``w`` as a weight: plain in ``dtype``, or quantised to ``fmt``."""
    if fmt == "plain":
        return w.to(DTYPES[dtype])
    if fmt.startswith("int_block"):  # "int_block" (symmetric int8, blocks of 32) or "int_block+offset" (16)
        return quantize_int_block(w, 16, offset=True) if fmt.endswith("+offset") else quantize_int_block(w)
    return quantize_fp8_block(w) if fmt == "fp8_block" else quantize_fp4_group(w)


def _product_ulps(dtype: str, fmt: str, k: int, why: str):
    """A product's tolerance: fp32 sums of K terms reassociate (sqrt(K) growth); a plain weight in a half
    dtype costs one output rounding, a dequantised one also its own rounding to the activation dtype."""
    return ulps(dtype, 4.0 * math.sqrt(k) if dtype == "float32" else (4 if fmt == "plain" else 8), why)


def _product_cost(rows: int, n: int, k: int, dtype: str, fmt: str) -> tuple[float, float]:
    w_elem = {"plain": _elem(dtype), "fp8_block": 1.0, "fp4_group": 0.5, "int_block": 1.125,
              "int_block+offset": 1.5}[fmt]
    return matmul_cost(rows, n, k, _elem(dtype), w_elem)


@cases_for("linear")
def linear() -> list[OpCase]:
    out = []
    sweep = [(16, 128, 256, False, "plain", "quick"), (5, 96, 64, True, "plain", "quick"),
             (8, 256, 256, False, "fp8_block", "quick"), (8, 128, 256, False, "fp4_group", "quick"),
             (1, 512, 256, False, "plain", "full"), (64, 256, 512, True, "plain", "full"),
             (33, 200, 384, False, "fp8_block", "full"), (17, 256, 512, False, "fp4_group", "full"),
             (3, 96, 128, False, "int_block", "quick"), (6, 80, 256, False, "int_block+offset", "quick"),
             (12, 200, 640, False, "int_block", "full"),
             # past 128 rows: a backend whose linear switches kernels at a row count (a decode kernel up to
             # 128 rows) is checked on both sides of the switch
             (136, 48, 96, True, "plain", "quick")]
    for t, n, k, bias, fmt, level in sweep:
        for dtype in _dtypes(level):
            def build(seed, t=t, n=n, k=k, bias=bias, fmt=fmt, dtype=dtype):
                g = gen(seed)
                dt = DTYPES[dtype]
                x = randn(g, t, k, dtype=dt)
                w = _weight(g, n, k, dtype, fmt)
                b = randn(g, n, dtype=dt) if bias else None
                return (x, w, b), {}

            def take(a, kw, m):
                return (a[0][:m], a[1], a[2]), {}

            def cost(a, kw, n=n, k=k, fmt=fmt, dtype=dtype):
                return _product_cost(a[0].shape[0], n, k, dtype, fmt)

            why = ("one output rounding; fp32 sums of K products in another order (sqrt(K) growth)"
                   if fmt == "plain" else "dequantised weights rounded to the activation dtype, then one rounding")
            label = f"T={t} N={n} K={k}" + (" +bias" if bias else "") + ("" if fmt == "plain" else f" {fmt}")
            out.append(OpCase("linear", label, dtype, build, _product_ulps(dtype, fmt, k, why), level, take=take,
                              cost=cost, **_ROWS0))
    return out


# ------------------------------------------------------------------------------------------- lm_head

@cases_for("lm_head")
def lm_head() -> list[OpCase]:
    out = []
    # vocabularies past the reference's 32,768-row chunks in full; with and without the caller's buffer
    sweep = [(4, 1000, 64, True, "plain", "quick"), (3, 256, 128, False, "fp8_block", "quick"),
             (1, 4096, 640, True, "plain", "full"), (32, 2048, 640, False, "plain", "full"),
             (5, 40000, 64, True, "plain", "full"), (9, 512, 256, True, "fp4_group", "full")]
    for t, v, k, buf, fmt, level in sweep:
        for dtype in _dtypes(level):
            def build(seed, t=t, v=v, k=k, buf=buf, fmt=fmt, dtype=dtype):
                g = gen(seed)
                w = _weight(g, v, k, dtype, fmt)
                args = (randn(g, t, k, dtype=DTYPES[dtype]), w)
                return (args + (torch.full((t, v), float("nan")),) if buf else args), {}

            def take(a, kw, m):
                return (a[0][:m], a[1], *(b[:m] for b in a[2:])), {}

            def cost(a, kw, v=v, k=k, fmt=fmt, dtype=dtype):
                flops, moved = _product_cost(a[0].shape[0], v, k, dtype, fmt)
                return flops, moved + a[0].shape[0] * v * (4 - _elem(dtype))  # the fp32 logits

            why = ("the linear's rounding to the activation dtype (fp32: sums of K products in another order), "
                   "then an exact widening to fp32")
            label = f"B={t} V={v} K={k}" + (" into out" if buf else "") + ("" if fmt == "plain" else f" {fmt}")
            # with a buffer, what is compared is the buffer: a backend that returns fresh logits fails
            out.append(OpCase("lm_head", label, dtype, build, _product_ulps(dtype, fmt, k, why), level, take=take,
                              cost=cost, output=(lambda r, a, kw: a[2]) if buf else None, **_ROWS0))
    return out


# ------------------------------------------------------------------------------------------- lm_head.argmax

@cases_for("lm_head.argmax")
def lm_head_argmax() -> list[OpCase]:
    """Each row gets a planted winner: a vocabulary row along the row's own hidden state (the signs of its
    entries, times 1/4), a clear margin above every other logit (so any correct product, in any order or
    precision, finds the same token). The hidden states are on a grid of 1/8, so a winner's logit is a sum of
    multiples of 1/32 that every summation order computes exactly. A plain weight also holds an exact copy of
    each winner at a higher index: a tie in any product (a GEMM may sum two output columns in different
    orders, e.g. an interpreter through the host's BLAS), which the lower index wins. (A quantised copy
    may land in another scale block: no longer a tie.)"""
    out = []
    sweep = [(4, 1000, 64, "plain", "quick"), (3, 256, 128, "fp8_block", "quick"), (1, 4096, 640, "plain", "full"),
             (32, 40000, 640, "plain", "full"), (9, 512, 256, "fp4_group", "full")]
    for t, v, k, fmt, level in sweep:
        for dtype in _dtypes(level):
            def build(seed, t=t, v=v, k=k, fmt=fmt, dtype=dtype):
                g = gen(seed)
                x = (randn(g, t, k) * 8).round().div(8).clamp(-4, 4).to(DTYPES[dtype])  # exact in bf16 too
                w = randn(g, v, k, scale=0.05)
                cols = torch.randperm(v // 2, generator=g)[:t]  # winners in the lower half, their copies above
                for i, c in enumerate(cols.tolist()):
                    w[c] = x[i].float().sign() * 0.25
                    if fmt == "plain":
                        w[v // 2 + c] = w[c]
                return (x, _weight_of(w, fmt, dtype)), {}

            def take(a, kw, m):
                return (a[0][:m], a[1]), {}

            def cost(a, kw, v=v, k=k, fmt=fmt, dtype=dtype):
                return _product_cost(a[0].shape[0], v, k, dtype, fmt)

            label = f"B={t} V={v} K={k}" + ("" if fmt == "plain" else f" {fmt}")
            out.append(OpCase("lm_head.argmax", label, dtype, build, EXACT, level, take=take, cost=cost,
                              rows=lambda a, kw: a[0].shape[0], row_slice=lambda o, a, kw, n: o[:n]))
    return out


# ------------------------------------------------------------------------------------------- act.gated

@cases_for("act.gated")
def act_gated() -> list[OpCase]:
    out = []
    # widths of real MLPs (Gemma 3 270M: I=2048) and, in full, odd ones: a vectorised elementwise kernel
    # treats a tensor's tail differently, which batch invariance must not see
    sweep = [(16, 256, "silu", "quick"), (5, 2048, "gelu_tanh", "quick"), (7, 640, "gelu_tanh", "quick"),
             (1, 1024, "silu", "full"), (64, 2048, "gelu_tanh", "full"), (33, 1408, "silu", "full"),
             (9, 100, "gelu_tanh", "full"), (5, 17, "silu", "full")]
    for t, i, kind, level in sweep:
        for dtype in _dtypes(level):
            def build(seed, t=t, i=i, kind=kind, dtype=dtype):
                g = gen(seed)
                dt = DTYPES[dtype]
                return (randn(g, t, i, dtype=dt, scale=3.0), randn(g, t, i, dtype=dt), ActParams(kind)), {}

            def take(a, k, n):
                return (a[0][:n], a[1][:n], a[2]), {}

            why = ("act(gate) (exp or tanh, a few fp32 ulps apart between libraries) times up: the reference rounds "
                   "act(gate) to the input dtype before the product, a fused kernel once at the end")
            tol = ulps(dtype, 2 if dtype != "float32" else 8, why)
            out.append(OpCase("act.gated", f"T={t} I={i} {kind}", dtype, build, tol, level, take=take, **_ROWS0,
                              cost=lambda a, k: (8.0 * a[0].numel(), 3 * nbytes(a[0]))))
    return out


# ------------------------------------------------------------------------------------------- embed

@cases_for("embed")
def embed() -> list[OpCase]:
    out = []
    for t, v, d, scale, level in [(12, 1000, 64, 8.0, "quick"), (1, 50, 640, math.sqrt(640), "full"),
                                  (64, 4096, 256, 1.0, "full")]:
        for dtype in ("float32", "bfloat16"):
            def build(seed, t=t, v=v, d=d, scale=scale, dtype=dtype):
                g = gen(seed)
                ids = torch.randint(0, v, (t,), generator=g, dtype=torch.long)
                return (ids, randn(g, v, d, dtype=DTYPES[dtype]), scale), {}

            def take(a, k, n):
                return (a[0][:n], a[1], a[2]), {}

            tol = ulps(dtype, 1, "one product with the scale, which is itself rounded to the table dtype")
            out.append(OpCase("embed", f"T={t} V={v} D={d} scale={scale:.3g}", dtype, build, tol, level, take=take,
                              **_ROWS0, cost=lambda a, k: (float(a[0].numel() * a[1].shape[1]),
                                                           2.0 * a[0].numel() * a[1].shape[1] * a[1].element_size())))
    return out


# ------------------------------------------------------------------------------------------- topk.select

@cases_for("topk.select")
def topk_select() -> list[OpCase]:
    out = []
    for t, s, k, valid, dtype, level in [(6, 100, 8, False, "float32", "quick"), (4, 300, 16, True, "float32", "quick"),
                                         (4, 2048, 512, True, "float32", "full"), (5, 64, 64, True, "float32", "full"),
                                         (8, 256, 32, False, "bfloat16", "full")]:
        def build(seed, t=t, s=s, k=k, valid=valid, dtype=dtype):
            g = gen(seed)
            scores = randn(g, t, s, dtype=DTYPES[dtype])  # bf16 rounding makes ties: broken by lower index
            vl = torch.randint(1, s + 1, (t,), generator=g) if valid else None
            return (scores, k), ({"valid_len": vl} if valid else {})

        def take(a, kw, n):
            return (a[0][:n], a[1]), {kk: v[:n] for kk, v in kw.items()}

        label = f"T={t} S={s} k={k}" + (" valid_len" if valid else "") + (" ties" if dtype == "bfloat16" else "")
        out.append(OpCase("topk.select", label, dtype, build, EXACT, level, take=take, **_ROWS0,
                          cost=lambda a, kw: (float(a[0].numel()), nbytes(a[0]))))
    return out
