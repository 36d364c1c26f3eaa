"""Reference MoE routing and grouped expert GEMMs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inferhal.core.ops.quantize import dequantize
from inferhal.core.ops.params import ExpertsParams, RouteParams
from inferhal.core.ops.quant import QuantWeight


def score(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    lf = logits.float()
    if scoring == "softmax":
        return torch.softmax(lf, dim=-1)
    if scoring == "sigmoid":
        return torch.sigmoid(lf)
    return torch.sqrt(F.softplus(lf))  # sqrtsoftplus


def moe_route(logits: torch.Tensor, p: RouteParams, bias: torch.Tensor | None = None,
              hash_ids: torch.Tensor | None = None, *, fixed_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] -> weights [T, K] fp32, ids [T, K] int64. ``topk(sorted=False)`` returns a row's experts
    in an order that can change with the number of rows (its CPU kernel differs), and the order is the
    summation order of the renormalisation and of the experts' outputs; ``fixed_order`` (batch-invariant
    mode) sorts each row's experts by id."""
    scores = score(logits, p.scoring)
    if hash_ids is not None:
        ids = hash_ids.long()
    else:
        choose = scores if bias is None else scores + bias.float()
        ids = torch.topk(choose, p.top_k, dim=-1, sorted=False).indices
    if fixed_order:
        ids = ids.sort(dim=-1).values
    w = scores.gather(1, ids)
    if p.renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * p.routed_scaling, ids


def _expert(w: torch.Tensor | QuantWeight, e: int, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(w, QuantWeight):
        sub = QuantWeight(w.data[e], w.scale[e], w.format, tuple(w.shape[1:]), w.block)
        return dequantize(sub, dtype)
    return w[e].to(dtype)


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up, w_down,
                p: ExpertsParams, *, mm=F.linear) -> torch.Tensor:
    # x: [T, D]; w_gate_up: [E, 2I, D]; w_down: [E, D, I]
    num_experts = w_gate_up.shape[0]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        if not 0 <= e < num_experts:
            continue
        tok, slot = torch.where(ids == e)
        gu = mm(x[tok], _expert(w_gate_up, e, x.dtype)).float()
        gate, up = gu.chunk(2, dim=-1)
        if p.swiglu_limit > 0:
            gate = gate.clamp(max=p.swiglu_limit)
            up = up.clamp(min=-p.swiglu_limit, max=p.swiglu_limit)
        h = (F.silu(gate) * up).to(x.dtype)
        y = mm(h, _expert(w_down, e, x.dtype)).float()
        out.index_add_(0, tok, y * weights[tok, slot, None].float())
    return out.to(x.dtype)


OPS = {
    "moe.route": moe_route,
    "moe.experts": moe_experts,
}
