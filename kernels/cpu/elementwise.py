"""bf16 RMSNorm, gated activations and NeoX rotary embedding in one pass per row (``elementwise.c``, built
by :mod:`inferhal.kernels.cpu.lib`), with the reference ops' rounding steps (see the C source)."""

from __future__ import annotations

import torch

from inferhal.kernels.cpu.lib import library

ACT_KINDS = {"gelu_tanh": 0, "silu": 1}


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, D]`` with unit column stride (a view when it can be one)."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] == 1 else t2.contiguous()


def supports_norm(x: torch.Tensor, scale: torch.Tensor | None, residual: torch.Tensor | None) -> bool:
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() >= 1 and x.shape[-1] > 0
            and (scale is None or (scale.dtype == torch.float32 and scale.shape == x.shape[-1:]))
            and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape)))


def rms_norm(x: torch.Tensor, scale: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None,
             checked: bool = False):
    """``y = (h * rsqrt(mean(h^2) + eps)) * scale`` per row of ``h = x (+ residual)`` (bf16; ``scale``
    fp32 ``[D]`` or None); returns ``y``, or ``(y, h)`` with a residual. ``checked``: the caller already
    asked :func:`supports_norm` (it runs at every norm of every step)."""
    if not checked and not supports_norm(x, scale, residual):
        raise ValueError(f"rms_norm: needs bf16 CPU x with an fp32 [D] scale, got x {x.dtype} {tuple(x.shape)}, "
                         f"scale {None if scale is None else (scale.dtype, tuple(scale.shape))}")
    x2 = _rows(x)
    rows, d = x2.shape
    y = torch.empty(rows, d, dtype=x.dtype)
    sc = None if scale is None else scale.contiguous().data_ptr()
    flat = x.dim() == 2  # [rows, D] already: no views back (a view costs about as much as the norm's call)
    if residual is None:
        library().ih_rms_norm_bf16(x2.data_ptr(), x2.stride(0), None, 0, sc, rows, d, eps, y.data_ptr(), d, None, 0)
        return y if flat else y.view(x.shape)
    r2 = _rows(residual)
    h = torch.empty(rows, d, dtype=x.dtype)
    library().ih_rms_norm_bf16(x2.data_ptr(), x2.stride(0), r2.data_ptr(), r2.stride(0), sc, rows, d, eps,
                               y.data_ptr(), d, h.data_ptr(), d)
    return (y, h) if flat else (y.view(x.shape), h.view(x.shape))


def supports_act(gate: torch.Tensor, up: torch.Tensor, kind: str) -> bool:
    return (gate.dtype == torch.bfloat16 and up.dtype == torch.bfloat16 and gate.shape == up.shape
            and gate.device.type == "cpu" and up.device.type == "cpu" and gate.dim() >= 1 and kind in ACT_KINDS)


def act_gated(gate: torch.Tensor, up: torch.Tensor, kind: str, checked: bool = False) -> torch.Tensor:
    """``bf16(act(gate)) * up`` in bf16, act ``gelu_tanh`` or ``silu`` (``checked``: see :func:`rms_norm`)."""
    if not checked and not supports_act(gate, up, kind):
        raise ValueError(f"act_gated: needs bf16 CPU gate and up of one shape and a kind in {sorted(ACT_KINDS)}, "
                         f"got {gate.dtype} {tuple(gate.shape)}, {up.dtype} {tuple(up.shape)}, {kind!r}")
    g2, u2 = _rows(gate), _rows(up)
    rows, n = g2.shape
    y = torch.empty(rows, n, dtype=gate.dtype)
    if rows and n:
        library().ih_act_gated_bf16(g2.data_ptr(), g2.stride(0), u2.data_ptr(), u2.stride(0), rows, n, ACT_KINDS[kind],
                                    y.data_ptr(), n)
    return y if gate.dim() == 2 else y.view(gate.shape)


def supports_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int, style: str) -> bool:
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 3 and style == "neox"
            and rotary_dim == x.shape[2] and rotary_dim % 2 == 0 and x.stride(2) == 1
            and cos_sin.dtype == torch.float32 and cos_sin.dim() == 2 and cos_sin.shape[1] == rotary_dim
            and positions.dim() == 1 and positions.shape[0] >= x.shape[0])


def rope_neox(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False,
              checked: bool = False) -> torch.Tensor:
    """NeoX rotation of whole heads: ``x [T, H, D]`` bf16 at ``positions [T]`` with ``cos_sin [P, D]`` fp32.
    A position outside the table is an IndexError. ``checked``: the caller already asked :func:`supports_rope`."""
    if not checked and not supports_rope(x, positions, cos_sin, x.shape[-1] if x.dim() == 3 else -1, "neox"):
        raise ValueError(f"rope_neox: needs bf16 x [T, H, D] and an fp32 [P, D] table, got {x.dtype} "
                         f"{tuple(x.shape)}, {cos_sin.dtype} {tuple(cos_sin.shape)}")
    t, h, d = x.shape
    pos = positions[:t].to(torch.int64).contiguous()
    cs = cos_sin.contiguous()
    out = torch.empty(t, h, d, dtype=x.dtype)
    if t:
        bad = library().ih_rope_neox_bf16(x.data_ptr(), x.stride(0), x.stride(1), t, h, d, cs.data_ptr(), cs.shape[0],
                                          pos.data_ptr(), int(inverse), out.data_ptr())
        if bad >= 0:
            raise IndexError(f"rope_neox: position {int(pos[bad])} (row {bad}) is outside the table's "
                             f"{cs.shape[0]} rows")
    return out
