"""``act.gated``: y = act(gate) * up of a dense MLP, act = SiLU or GELU's tanh approximation (Gemma). One
program per (row, ``BLOCK_I`` columns). Oracle: ``backends/reference/ops.py:act_gated``, which rounds
act(gate) to the input dtype before the product: so does the kernel (then the product once more).
tanh(z) is written 1 - 2 / (exp(2z) + 1) (no tanh in every Triton backend; a few fp32 ulps from libm's).

(SwiGLU with DeepSeek-V4's clamp lives in ``moe.experts``, :mod:`.moe_experts`: ``act.gated`` has no limit.)"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferhal.core.ops.params import ActParams
from inferhal.kernels.common import interp, round_to, tl_dtype
from inferhal.kernels.runtime import next_pow2
from inferhal.kernels.tuning import config

SILU, GELU_TANH = 0, 1


@triton.jit
def act_gated_kernel(g_ptr, u_ptr, y_ptr, I, stride_g, stride_u, stride_y, KIND: tl.constexpr,
                     DTYPE: tl.constexpr, BLOCK_I: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    m = c < I
    g = tl.load(g_ptr + t * stride_g + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + t * stride_u + c, mask=m, other=0.0).to(tl.float32)
    if KIND == 0:
        a = g / (1.0 + tl.exp(-g))
    else:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2/pi) (g + 0.044715 g^3)
        z = tl.minimum(tl.maximum(z, -15.0), 15.0)  # tanh(+-15) is +-1 in fp32; exp stays finite
        th = 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)
        a = 0.5 * g * (1.0 + th)
    a = round_to(a, DTYPE, INTERP).to(tl.float32)
    tl.store(y_ptr + t * stride_y + c, round_to(a * u, DTYPE, INTERP), mask=m)


def act_gated(gate: torch.Tensor, up: torch.Tensor, p: ActParams, *, target: str | None = None) -> torch.Tensor:
    """``act.gated``: gate[..., I], up[..., I] -> act(gate) * up in their dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"act.gated: gate {gate.dtype} {tuple(gate.shape)} and up {up.dtype} {tuple(up.shape)} differ")
    i = gate.shape[-1]
    g2 = gate.reshape(-1, i)
    u2 = up.reshape(-1, i)
    g2 = g2 if g2.stride(-1) == 1 else g2.contiguous()
    u2 = u2 if u2.stride(-1) == 1 else u2.contiguous()
    y = torch.empty((g2.shape[0], i), dtype=gate.dtype, device=gate.device)
    if g2.shape[0] and i:
        cfg = config("act_gated", target)
        bi = min(cfg["BLOCK_I"], next_pow2(i))
        act_gated_kernel[(g2.shape[0], triton.cdiv(i, bi))](
            g2, u2, y, i, g2.stride(0), u2.stride(0), y.stride(0), KIND=GELU_TANH if p.kind == "gelu_tanh" else SILU,
            DTYPE=tl_dtype(gate.dtype), BLOCK_I=bi, INTERP=interp(), num_warps=cfg["num_warps"])
    return y.view(gate.shape)
