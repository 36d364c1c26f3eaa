"""Greedy tokens from a bf16 LM head without materialising its logits (``head_argmax.c``, built by
:mod:`inferhal.kernels.cpu.lib`): the index of each row's largest bf16-rounded ``x . w^T`` as
:mod:`inferhal.kernels.cpu.amx`'s AVX-512 product computes it (first index on ties), exactly.

An int8 screen (AVX512-VNNI) reads half the bytes of the bf16 head and gives, per logit, an estimate with a
rigorous error bound; only the columns whose upper bound reaches the row's best lower bound are recomputed
exactly with the bf16 kernel's own instruction and order, from the head itself (row-major: a candidate's
values are contiguous). At decode sizes the head is bound by memory, so halving its bytes nearly halves
its time; from 8-16 rows on it is bound by the screen's int8 multiply-adds (see docs/performance.md).

The bound on ``|A - L|``, for activations ``x`` (one int8 scale per :data:`GROUP` channels, residual
``dx``) and a head row ``w`` (one int8 scale ``sw``, residual ``dw``), with ``x . w - xh . wh = x . dw +
dx . wh`` and Cauchy-Schwarz:

    ``||x|| ||dw|| + ||dx|| ||wh||``   (the quantisation)
    ``+ gamma_K ||x|| ||w||``          (the exact kernel's K fp32 roundings, ``gamma_K = K u / (1 - K u)``)
    ``+ sw * (groups + 6) u (P + |C|)`` (the screen's own fp32 arithmetic; P and C per row, below)

computed in float64 and rounded up; the kernel widens it again for its own fp32 evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferhal.kernels.cpu.lib import cpu_flags, library

#: activation channels per int8 scale (head_argmax.c's GROUP)
GROUP = 64
#: candidates kept per row and thread before a row is handed back to the full head
CAPACITY = 16384
#: /proc/cpuinfo flag the screen needs beyond the AVX-512 kernels' own
VNNI_FLAG = "avx512_vnni"
#: largest |value| of a head or a hidden row the screen takes: the bf16 kernels treat denormal inputs as zero
#: and flush tiny results, which moves a logit by less than 2 K 2^-126 MAX_ABS, inside the bound's slack
MAX_ABS = 2.0 ** 60


@dataclass(frozen=True)
class QuantHead:
    """A head ``[n, k]`` as the screen reads it: ``wq`` uint8 ``[n/32, k/4, 32, 4]`` (int8 + 128), ``col``
    fp32 ``[3, npad]``: each row's scale ``sw``, ``||dw|| + gamma_K ||w||`` and ``||wh||``, rounded up."""

    wq: torch.Tensor
    col: torch.Tensor
    n: int
    k: int


def available() -> bool:
    """Whether this CPU has the screen's instructions (the library itself is checked by its callers)."""
    return VNNI_FLAG in cpu_flags()


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`argmax` takes ``x [m, k]`` against the head ``w [n, k]`` (bf16 on the CPU, rows
    contiguous at an even stride, every pair of it within a 32-bit gather index of the exact step)."""
    return (x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and x.is_cpu and w.is_cpu and x.dim() == 2
            and w.dim() == 2 and x.shape[1] == w.shape[1] and w.shape[1] % GROUP == 0 and w.shape[0] > 0
            and w.stride(1) == 1 and w.stride(0) % 2 == 0 and w.stride(0) * (w.shape[0] - 1) + w.shape[1] < 2 ** 32)


def quantize(w: torch.Tensor) -> QuantHead | None:
    """The screen's copy of a bf16 head ``w [n, k]`` (``head_argmax.c``'s ``ih_head_quantize``, rows in
    parallel, float64 norms); None when ``w`` has a value that is not finite or past :data:`MAX_ABS` (no
    bound is kept then, and the caller runs the full head)."""
    if not supports(w[:1], w):
        raise ValueError(f"head quantize: needs a bf16 CPU head [n, k] with k % {GROUP} == 0 and contiguous rows "
                         f"at an even stride, got {w.dtype} {tuple(w.shape)} stride {w.stride()} on {w.device}")
    lib = library()
    n, k = w.shape
    npad = -(-n // 32) * 32
    wq = torch.empty(npad // 32, k // 4, 32, 4, dtype=torch.uint8)
    col = torch.empty(3, npad, dtype=torch.float32)
    if lib.ih_head_quantize(w.data_ptr(), n, k, w.stride(0), wq.data_ptr(), col.data_ptr()) >= 0:
        return None
    return QuantHead(wq, col, n, k)


def rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The screen's copy of bf16 rows ``x [m, k]`` (``head_argmax.c``'s ``ih_head_rows``, float64): int8
    ``xq [m, k]``, one scale per :data:`GROUP` channels ``sx [m, k / GROUP]``, per row ``[m, 4]`` = ``C``
    (the +128 offset of the weights: ``sum_g sx_g 128 sum xq``), ``||x||``, ``||dx||`` and the screen
    arithmetic's ``e = (groups + 6) u 1.02 (P + |C|)``, ``P = sum_g sx_g 255 sum |xq|`` (the last three
    rounded up), and ``bad [m]``: rows holding a value that is not finite or past :data:`MAX_ABS`, which
    the bound does not cover (their ``xq``, scales and constants are zeros)."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    xq = torch.empty(m, k, dtype=torch.int8)
    sx = torch.empty(m, k // GROUP, dtype=torch.float32)
    consts = torch.empty(m, 4, dtype=torch.float32)
    bad = torch.empty(m, dtype=torch.int32)
    library().ih_head_rows(x.data_ptr(), x.stride(0), m, k, xq.data_ptr(), sx.data_ptr(), consts.data_ptr(),
                           bad.data_ptr())
    return xq, sx, consts, bad.bool()


def argmax(x: torch.Tensor, w: torch.Tensor, head: QuantHead) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [m, k]`` bf16 against the head ``w [n, k]`` (as :func:`supports` takes it; ``head``: its
    :func:`quantize`) -> ``(tokens [m] int64, overflow [m] bool)``: where ``overflow`` is set, that row's
    candidates did not fit (or its logits left fp32's range) and its token is not computed (the caller runs
    the full head for it); so is it for a row the bound does not cover (a value not finite or past
    :data:`MAX_ABS`)."""
    lib = library()
    if not (x.dtype == torch.bfloat16 and x.is_cpu and x.dim() == 2 and x.shape[1] == head.k):
        raise ValueError(f"head argmax: needs bf16 CPU x [m, {head.k}], got {x.dtype} {tuple(x.shape)}")
    if tuple(w.shape) != (head.n, head.k) or not supports(x, w):
        raise ValueError(f"head argmax: needs the quantised head's own bf16 CPU w [{head.n}, {head.k}] with "
                         f"contiguous rows at an even stride, got {w.dtype} {tuple(w.shape)} stride {w.stride()}")
    m = x.shape[0]
    if m == 0:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.bool)
    if x.stride(1) != 1:
        x = x.contiguous()
    xq, sx, consts, bad = rows(x)
    if bool(bad.any()):  # rows the bound does not cover go back to the caller; the others are screened
        tokens = torch.zeros(m, dtype=torch.int64)
        keep = (~bad).nonzero()[:, 0]
        if keep.numel():
            t, o = _screen(x[keep], xq[keep], sx[keep], consts[keep], w, head, lib)
            tokens[keep], bad[keep] = t, o
        return tokens, bad
    return _screen(x, xq, sx, consts, w, head, lib)


def _screen(x, xq, sx, consts, w, head, lib) -> tuple[torch.Tensor, torch.Tensor]:
    m = x.shape[0]
    tokens = torch.empty(m, dtype=torch.int64)
    overflow = torch.zeros(m, dtype=torch.int32)
    rc = lib.ih_head_argmax_i8(xq.data_ptr(), sx.data_ptr(), consts.data_ptr(), x.data_ptr(), x.stride(0), m,
                               head.k, head.wq.data_ptr(), head.col.data_ptr(), w.data_ptr(), w.stride(0), head.n,
                               CAPACITY, tokens.data_ptr(), overflow.data_ptr())
    if rc < 0:
        raise MemoryError(f"head argmax: no memory for {m} rows' candidates")
    return tokens, overflow.bool()
