"""The bf16 linears over AMX's tile layout (built by :mod:`inferhal.kernels.cpu.lib`): ``amx_linear.c`` on
AMX tiles, ``avx512_linear.c`` with AVX512-BF16 dot products (``vdpbf16ps``) for CPUs without AMX.

Weights are packed once into the AMX tile layout (:func:`pack`) and kept per weight tensor, as the
reference keeps its oneDNN copies (:class:`inferhal.backends.reference.matmul.PackCache`); a row of a B
tile (one k pair of 16 columns) is also the AVX-512 kernel's operand, so both read the same copy. The
product can write fp32 results, or the bf16-rounded ones widened to fp32 (a bf16 model's logits), into a
caller's buffer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inferhal.kernels.cpu.lib import library

#: the reduction dimension runs in whole AMX tiles (32 bf16)
K_MULTIPLE = 32
ROW_TILE = 16
#: the kernels :func:`linear` runs
KERNELS = ("amx", "avx512")
# output modes of the C kernels
_OUT_BF16, _OUT_F32, _OUT_F32_OF_BF16 = 0, 1, 2


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`linear` runs ``x [.., K] . w [N, K]^T`` (else a caller uses another product)."""
    return (x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and x.device.type == "cpu"
            and w.device.type == "cpu" and w.dim() == 2 and x.dim() >= 1 and x.shape[-1] == w.shape[1]
            and w.shape[1] % K_MULTIPLE == 0 and w.shape[0] > 0 and w.stride(1) == 1)


def pack(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` bf16 (K a multiple of 32, rows contiguous) in the kernel's tile layout (N padded to 32)."""
    if not supports(w[:0, :], w):
        raise ValueError(f"pack: needs a bf16 CPU weight [N, K] with K % {K_MULTIPLE} == 0 and unit column "
                         f"stride, got {w.dtype} {tuple(w.shape)} stride {tuple(w.stride())} on {w.device}")
    lib = library()  # packing runs plain C: any CPU the library loads on
    n, k = w.shape
    out = torch.empty(lib.ih_amx_packed_elems(n, k), dtype=torch.bfloat16)
    lib.ih_amx_pack(w.data_ptr(), n, k, w.stride(0), out.data_ptr())
    return out


def _output(lead: tuple[int, ...], m: int, n: int, out_dtype: torch.dtype, out: torch.Tensor | None,
            bf16_values: bool) -> tuple[torch.Tensor, int]:
    """The ``[m, n]`` result buffer (``out`` checked, or a new one) and the kernel's output mode."""
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"linear: out_dtype must be bfloat16 or float32, got {out_dtype}")
    if bf16_values and out_dtype != torch.float32:
        raise ValueError("linear: bf16_values widens bf16-rounded sums into an fp32 output; out_dtype is bfloat16")
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype)
    else:
        bad = (out.dtype != out_dtype or tuple(out.shape) != (*lead, n) or out.device.type != "cpu"
               or out.stride(-1) != 1)
        if not bad:
            try:
                out = out.view(m, n)
            except RuntimeError:
                bad = True
        if bad or (m > 1 and out.stride(0) < n):
            raise ValueError(f"linear: out is {out.dtype} {tuple(out.shape)} stride {tuple(out.stride())} on "
                             f"{out.device}, needs {out_dtype} {(*lead, n)} in rows of unit column stride on the CPU")
    mode = _OUT_BF16 if out_dtype == torch.bfloat16 else (_OUT_F32_OF_BF16 if bf16_values else _OUT_F32)
    return out, mode


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, out_dtype: torch.dtype = torch.bfloat16, *,
           out: torch.Tensor | None = None, bf16_values: bool = False, kernel: str = "amx") -> torch.Tensor:
    """``x [..., K] . w^T`` -> ``[..., n]`` in ``out_dtype`` (bf16: fp32 sums rounded to nearest even, as
    torch casts; or fp32), from ``packed = pack(w)``, written into ``out`` when given. ``bf16_values``: an
    fp32 output holds the bf16-rounded sums (a bf16 product widened, in one pass). ``kernel``: ``amx`` or
    ``avx512`` (:data:`KERNELS`). Each row's sum runs in one fixed order whatever the number of rows, so
    results are batch-invariant."""
    if kernel not in KERNELS:
        raise ValueError(f"linear: kernel must be one of {KERNELS}, got {kernel!r}")
    lib = library(amx=kernel == "amx")
    k = x.shape[-1]
    if packed.numel() != lib.ih_amx_packed_elems(n, k):
        raise ValueError(f"linear: packed weight has {packed.numel()} elements, not a packed [{n}, {k}] weight")
    flat = x.dim() == 2  # [m, K] already: no reshape and no view back (each costs about a microsecond or two)
    x2 = x if flat else x.reshape(-1, k)
    m = x2.shape[0]
    y, mode = _output(tuple(x.shape[:-1]), m, n, out_dtype, out, bf16_values)
    if m > 0 and kernel == "avx512":  # it reads only the m rows
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        lib.ih_avx512_linear(x2.data_ptr(), m, k, x2.stride(0), packed.data_ptr(), n, y.data_ptr(), y.stride(0), mode)
    elif m > 0:
        mp = -(-m // ROW_TILE) * ROW_TILE
        if mp != m or x2.stride(1) != 1:  # the kernel reads whole 16-row tiles
            x2 = F.pad(x2, (0, 0, 0, mp - m)).contiguous()
        lib.ih_amx_linear(x2.data_ptr(), mp, m, k, x2.stride(0), packed.data_ptr(), n, y.data_ptr(), y.stride(0), mode)
    return y if flat else y.view(*x.shape[:-1], n)
