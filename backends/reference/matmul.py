"""The reference's matrix products, with an optional batch-invariant mode.

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
