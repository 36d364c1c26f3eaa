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
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    xp = F.pad(x2, (0, 0, 0, -m % TILE_ROWS))
    out = torch.cat([F.linear(xp[i : i + TILE_ROWS], w, bias) for i in range(0, xp.shape[0], TILE_ROWS)])
    return out[:m].reshape(*lead, w.shape[0])
