"""The reference's RMSNorm and rotary embedding (ops ``norm.rms`` and ``rope.apply``), a module of their own so
that the model-specific op modules (``deepseek.py``) use them without importing :mod:`.ops`, which collects them."""

from __future__ import annotations

import weakref

import torch

from inferhal.core.ops.params import RmsNormParams, RopeParams


_NORM_SCALES: dict = {}


def norm_scale(weight: torch.Tensor, unit_offset: bool) -> torch.Tensor:
    """``weight`` in fp32 (plus one with ``unit_offset``), kept per weight tensor and version: a model
    calls its norms every step with the same weights, and widening them was a fifth of each call."""
    try:
        key = (id(weight), unit_offset, weight._version, weight.dtype, weight.device)
    except RuntimeError:  # an inference-mode tensor keeps no version counter
        key = None
    hit = _NORM_SCALES.get(key) if key is not None else None
    if hit is not None and hit[0]() is weight:
        return hit[1]
    w = weight.float()
    scale = 1.0 + w if unit_offset else w
    if scale is weight:  # fp32 already: nothing to keep (an entry would hold the weight itself, and with it
        return scale  # the memory-mapped weight file it views, after its model was dropped)
    if key is not None:
        if len(_NORM_SCALES) > 4096:
            _NORM_SCALES.clear()
        # a weak reference: a norm weight is often a view of a whole memory-mapped weight file, which a
        # strong one kept mapped after its model was dropped (0.5 GB per Gemma 3 load in a test session)
        _NORM_SCALES[key] = (weakref.ref(weight), scale)
    return scale


def norm_rms(
    x: torch.Tensor, weight: torch.Tensor | None, p: RmsNormParams, residual: torch.Tensor | None = None
):
    h = x if residual is None else x + residual
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + p.eps)
    if weight is not None:
        y = y * norm_scale(weight, p.unit_offset)
    y = y.to(x.dtype)
    return y if residual is None else (y, h)


_ROPE_ROWS: dict = {}


def _rope_rows(cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``cos_sin[positions]`` in fp32 ``[T, R]``, kept per table and positions tensor (and their version
    counters): every layer of a step rotates q and k at the same positions (36 gathers a step for Gemma 3)."""
    try:
        key = (id(cos_sin), cos_sin._version, id(positions), positions._version)
    except RuntimeError:  # inference-mode tensors keep no version counter
        key = None
    hit = _ROPE_ROWS.get(key) if key is not None else None
    if hit is not None and hit[0] is cos_sin and hit[1] is positions:
        return hit[2]
    cs = cos_sin[positions.long()].float()
    if key is not None:
        if len(_ROPE_ROWS) >= 8:  # a new step: the previous step's positions are done with
            _ROPE_ROWS.clear()
        _ROPE_ROWS[key] = (cos_sin, positions, cs)
    return cs


def rope_apply(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, p: RopeParams) -> torch.Tensor:
    # x: [T, H, D]; cos_sin: [P, R] = [cos(R/2) | sin(R/2)]
    r = p.rotary_dim
    cs = _rope_rows(cos_sin, positions)  # [T, R]
    cos, sin = cs[:, None, : r // 2], cs[:, None, r // 2 :]
    if p.inverse:
        sin = -sin
    rot = x[..., :r] if p.placement == "head" else x[..., -r:]
    rf = rot.float()
    if p.style == "neox":
        a, b = rf[..., : r // 2], rf[..., r // 2 :]
        out = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    else:
        a, b = rf[..., 0::2], rf[..., 1::2]
        out = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    out = out.to(x.dtype)
    if r == x.shape[-1]:
        return out
    if p.placement == "head":
        return torch.cat((out, x[..., r:]), dim=-1)
    return torch.cat((x[..., :-r], out), dim=-1)
