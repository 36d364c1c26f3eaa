"""The reference's matrix products, with an optional batch-invariant mode.

:func:`product` is the default: ``F.linear``, except fp32 on the CPU, which goes through oneDNN's
fp32 kernel (full fp32, another blocking) where torch has it. On the development machines (AMD EPYC)
torch's fp32 ``F.linear`` runs MKL's GEMM at about half the speed of oneDNN's: 190 vs 91 ms for
Gemma 3's LM head at 32 rows, 5.2 vs 2.4 ms for a 200×640·640×2048 product (one thread). bf16 already
runs through oneDNN in ``F.linear``. Both fp32 paths stay within a few fp32 ulps of a float64 product.

CPU BLAS picks a different kernel (and so a different summation order) for different row counts, so a
row's result from ``F.linear`` can change in the last bits with the batch it shares. In batch-invariant
mode (``backend.batch_invariant=true``) every product runs over fixed tiles of
:data:`TILE_ROWS` rows, zero-padded, so each row sees the same kernel whatever the batch. It costs
speed, which is why it is a mode and not the default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TILE_ROWS = 16


def _onednn_fp32():
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    return op if op is not None and torch.backends.mkldnn.is_available() else None


_ONEDNN = _onednn_fp32()


def product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)``: x [..., K], w [N, K] -> [..., N]; fp32 on the CPU through oneDNN."""
    if (_ONEDNN is None or x.dtype != torch.float32 or w.dtype != torch.float32 or x.device.type != "cpu"
            or w.device.type != "cpu" or x.numel() == 0 or x.dim() < 2):
        return F.linear(x, w, bias)
    x2 = x.reshape(-1, x.shape[-1])
    out = _ONEDNN(x2, w, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], w.shape[0])


def tiled_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [M, K] (or [..., K]); w: [N, K] -> [M, N], identical per row for any M
    x2 = x.reshape(-1, x.shape[-1])
    return row_tiled(F.linear, (0,))(x2, w, bias).reshape(*x.shape[:-1], w.shape[0])


def row_tiled(fn, row_args: tuple[int, ...]):
    """``fn`` run over fixed tiles of :data:`TILE_ROWS` rows (zero-padded) of its positional arguments
    ``row_args``, outputs concatenated. CPU elementwise loops compute a vector's tail with scalar code
    whose last bit can differ, and where a row's elements land depends on the batch size; fixed tiles
    make each row's elements land in the same places whatever the batch."""
    import functools

    @functools.wraps(fn)
    def tiled(*args, **kwargs):
        m = args[row_args[0]].shape[0]
        padded = list(args)
        for i in row_args:
            padded[i] = F.pad(args[i], (0, 0) * (args[i].dim() - 1) + (0, -m % TILE_ROWS))
        outs = []
        for s in range(0, max(m, 1) + (-max(m, 1) % TILE_ROWS), TILE_ROWS):
            part = list(padded)
            for i in row_args:
                part[i] = padded[i][s : s + TILE_ROWS]
            outs.append(fn(*part, **kwargs))
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(o)[:m] for o in zip(*outs))
        return torch.cat(outs)[:m]

    return tiled
