"""One step's time on one device, as a roofline: each phase takes ``max(bytes / bandwidth, flops / peak)``,
the phases add up (no overlap between them is assumed), and the EP all-to-all adds its bytes over the
links. What it leaves out, on purpose and stated in every report: kernel launch and collective latency,
host (Python/scheduler) time, achieved-versus-peak efficiency, and expert load imbalance (experts are
taken as evenly loaded, as a perfect EPLB would make them).

A step serves ``tokens`` tokens on each attention rank (``dp`` ranks of ``tp`` devices each), with ``rows``
of them producing logits. Routed experts are spread over ``ep`` devices (``ep`` = ``dp * tp``) or, with
``ep == 1``, held by every device (split ``tp`` ways).
"""

from __future__ import annotations

from dataclasses import dataclass

from inferhal.core.errors import UserError
from inferhal.core.plan.hardware import Link


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    dp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "ep"):
            if int(getattr(self, name)) < 1:
                raise UserError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.ep not in (1, self.devices):
            raise UserError(f"parallel.ep={self.ep} with tp={self.tp}, dp={self.dp}: the planner models EP over every "
                            f"device of the layout (ep = dp*tp = {self.devices}) or none (ep = 1)")

    @property
    def devices(self) -> int:
        return self.tp * self.dp


@dataclass(frozen=True)
class Machine:
    """What a step runs on: bandwidth (bytes/s), product rate and attention rate (FLOP/s), links."""

    bandwidth: float
    product_rate: float
    attention_rate: float
    scale_up: Link | None = None
    scale_out: Link | None = None
    expert_rate: float = 0.0  # routed-expert products, when they run at another rate (0: product_rate)


@dataclass(frozen=True)
class Weights:
    """Bytes per device of each class, and parameters per token for FLOPs."""

    dense_bytes: float  # attention projections, shared experts, ... (all of them, before TP)
    dense_params: float
    head_bytes: float
    head_params: float
    expert_bytes: float  # one routed expert in one layer
    expert_params: float
    n_experts: int
    top_k: int
    moe_layers: int
    hidden: int
    act_bytes: float  # bytes per element of a dispatched activation
    kv_heads: int = 1
    layers: int = 0  # transformer layers (each all-reduces twice under TP)


def phase(nbytes: float, flops: float, bw: float, rate: float) -> dict:
    t_mem, t_fl = nbytes / bw, (flops / rate if flops else 0.0)
    return {"bytes": nbytes, "flops": flops, "s": max(t_mem, t_fl), "bound": "memory" if t_mem >= t_fl else "compute"}


def touched(n_experts: int, top_k: int, tokens: float) -> float:
    """Expected share of experts at least one of ``tokens`` routes to (uniform routing)."""
    if n_experts == 0 or tokens <= 0:
        return 0.0
    return 1.0 - (1.0 - top_k / n_experts) ** tokens


def all_to_all_s(tokens_per_device: float, w: Weights, layout: Layout, m: Machine) -> tuple[float, float, str]:
    """Seconds of one MoE layer's dispatch + combine on one device, its bytes sent, and the link that binds.
    Dispatch sends ``act_bytes`` per hidden element, combine returns bf16 (2 bytes); each token goes to
    ``top_k`` experts, uniformly over the ``ep`` devices (the share on its own device stays)."""
    ep = layout.ep
    if ep <= 1 or w.moe_layers == 0:
        return 0.0, 0.0, "-"
    sent = tokens_per_device * w.top_k * (ep - 1) / ep * w.hidden * (w.act_bytes + 2.0)
    up_domain = min(ep, m.scale_up.domain) if m.scale_up else 1
    near = (up_domain - 1) / (ep - 1)
    near_b, far_b = sent * near, sent * (1 - near)
    t, link = 0.0, "-"
    if near_b:
        if not m.scale_up or m.scale_up.bandwidth <= 0:
            raise UserError("the device declares no scale-up link bandwidth: EP all-to-all cannot be planned")
        t, link = near_b / m.scale_up.bandwidth, m.scale_up.name
    if far_b:
        if not m.scale_out or m.scale_out.bandwidth <= 0:
            raise UserError(f"parallel.ep={ep} spans more than one scale-up domain ({up_domain} devices) and the "
                            f"device declares no scale-out bandwidth")
        t_far = far_b / m.scale_out.bandwidth
        if t_far > t:
            t, link = t_far, m.scale_out.name
    return t, sent, link


def step(tokens: float, rows: float, kv_read: float, attn_flops: float, w: Weights, layout: Layout,
         m: Machine) -> dict:
    """One step on one device. ``tokens``/``rows``: per attention rank; ``kv_read``: KV bytes the rank's
    requests read; ``attn_flops``: their attention FLOPs. Returns the phases and the total seconds."""
    tp, dp, ep = layout.tp, layout.dp, layout.ep
    ph = {
        "dense": phase(w.dense_bytes / tp, 2 * tokens * w.dense_params / tp, m.bandwidth, m.product_rate),
        # one latent KV head cannot be split: each TP rank reads all of its requests' KV
        "attention": phase(kv_read / min(tp, w.kv_heads), attn_flops / tp, m.bandwidth, m.attention_rate),
        "head": phase(w.head_bytes / tp, 2 * rows * w.head_params / tp, m.bandwidth, m.product_rate),
    }
    if w.moe_layers:
        if ep > 1:
            routed = tokens * dp * w.top_k / ep  # token-expert pairs one device computes (even load)
            held = w.n_experts / ep
            share = touched(w.n_experts, w.top_k, tokens * dp)
            nbytes = held * share * w.expert_bytes * w.moe_layers
            flops = 2 * routed * w.expert_params * w.moe_layers
        else:
            share = touched(w.n_experts, w.top_k, tokens)
            nbytes = w.n_experts * share * w.expert_bytes * w.moe_layers / tp
            flops = 2 * tokens * w.top_k * w.expert_params * w.moe_layers / tp
        ph["experts"] = phase(nbytes, flops, m.bandwidth, m.expert_rate or m.product_rate)
        t, sent, link = all_to_all_s(tokens / tp, w, layout, m)  # each device of a rank dispatches 1/tp of its tokens
        ph["all_to_all"] = {"bytes": sent * w.moe_layers, "flops": 0.0, "s": t * w.moe_layers, "bound": link}
    if tp > 1:  # attention output and FFN output reduced over the TP group: ring all-reduce of bf16 rows
        sent = 2 * w.layers * tokens * w.hidden * 2.0 * 2 * (tp - 1) / tp
        if not m.scale_up or m.scale_up.bandwidth <= 0 or m.scale_up.domain < tp:
            raise UserError(f"parallel.tp={tp}: the device declares no scale-up link reaching {tp} devices")
        ph["all_reduce"] = {"bytes": sent, "flops": 0.0, "s": sent / m.scale_up.bandwidth, "bound": m.scale_up.name}
    total = sum(p["s"] for p in ph.values())
    return {"s": total, "phases": ph}
