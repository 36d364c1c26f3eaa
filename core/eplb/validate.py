"""Checks on what goes into and comes out of the policy: load tensors and placement plans.

Both raise :class:`EplbInputError` / :class:`PlacementError` (``ValueError`` subclasses) whose message
names the argument, the layer and the expert or GPU at fault, so a bad plan never reaches the weights.
"""

from __future__ import annotations

import torch


class EplbInputError(ValueError):
    """A load tensor or a policy argument is unusable (NaN, negative, wrong shape, bad sizes)."""


class PlacementError(ValueError):
    """A placement plan breaks an invariant; the plan in use is kept."""


def check_layout(num_logical: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> bool:
    """Validate the sizes; return True when the hierarchical policy applies (groups divide among nodes)."""
    for name, v in (("num_replicas", num_replicas), ("num_groups", num_groups),
                    ("num_nodes", num_nodes), ("num_gpus", num_gpus)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise EplbInputError(f"{name} must be a positive int, got {v!r}")
    if num_replicas < num_logical:
        raise EplbInputError(f"num_replicas={num_replicas} is fewer than the {num_logical} logical experts")
    if num_replicas % num_gpus:
        raise EplbInputError(f"num_replicas={num_replicas} is not a multiple of num_gpus={num_gpus}")
    hierarchical = num_groups % num_nodes == 0
    if hierarchical:
        if num_logical % num_groups:
            raise EplbInputError(f"{num_logical} experts do not split into num_groups={num_groups} equal groups")
        if num_gpus % num_nodes:
            raise EplbInputError(f"num_gpus={num_gpus} is not a multiple of num_nodes={num_nodes}")
    return hierarchical


def check_drift(drift) -> float:
    """The policy's ``drift`` (relative drift of an expert's load by the next window) as a float."""
    if isinstance(drift, bool) or not isinstance(drift, (int, float)) or not 0 <= drift < 10:
        raise EplbInputError(f"drift must be a number in [0, 10) (relative drift per expert; 0 = plan for the "
                             f"current window alone), got {drift!r}")
    return float(drift)


def check_load(weight: torch.Tensor, name: str = "weight", num_logical: int | None = None) -> torch.Tensor:
    """Return ``weight`` as a float32 CPU ``[L, E]`` tensor, or raise naming the first bad entry."""
    if not isinstance(weight, torch.Tensor):
        raise EplbInputError(f"{name} must be a torch.Tensor [layers, experts], got {type(weight).__name__}")
    if weight.dim() != 2 or weight.shape[0] < 1 or weight.shape[1] < 1:
        raise EplbInputError(f"{name} must have shape [layers, experts] with both >= 1, got {tuple(weight.shape)}")
    if num_logical is not None and weight.shape[1] != num_logical:
        raise EplbInputError(f"{name} has {weight.shape[1]} experts per layer, expected {num_logical}")
    if weight.is_complex() or weight.dtype == torch.bool:
        raise EplbInputError(f"{name} must be real-valued, got dtype {weight.dtype}")
    w = weight.detach().to("cpu", torch.float32)
    bad = ~torch.isfinite(w)
    if bad.any():
        l, e = (int(i) for i in bad.nonzero()[0])
        kind = "NaN" if torch.isnan(w[l, e]) else "infinite"
        raise EplbInputError(f"{name} has {int(bad.sum())} {kind}/non-finite entries, first at layer {l}, expert {e}")
    neg = w < 0
    if neg.any():
        l, e = (int(i) for i in neg.nonzero()[0])
        raise EplbInputError(f"{name} has {int(neg.sum())} negative entries, first at layer {l}, expert {e} "
                             f"(= {float(w[l, e])}); loads are token counts")
    return w


def validate_placement(phy2log: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, *, num_logical: int,
                       num_gpus: int, num_groups: int = 1, num_nodes: int = 1,
                       hierarchical: bool | None = None) -> None:
    """Raise :class:`PlacementError` unless the plan is consistent and complete.

    Checks: shapes ``phy2log[L, R]``, ``log2phy[L, E, M]``, ``logcnt[L, E]``; every slot holds an expert in
    ``[0, E)`` (so each GPU ``g`` holds exactly its ``R // num_gpus`` slots ``g*S .. g*S+S-1``); every
    expert has at least one replica; ``logcnt`` counts the replicas; ``log2phy[l, e]`` lists exactly the
    slots holding ``e``, in ascending order, padded with -1; and, hierarchical (default: when
    ``num_groups % num_nodes == 0`` and ``num_nodes > 1``), all replicas of a group's experts lie on one node.
    """
    if phy2log.dim() != 2:
        raise PlacementError(f"phy2log must be [layers, replicas], got shape {tuple(phy2log.shape)}")
    L, R = phy2log.shape
    if R % num_gpus:
        raise PlacementError(f"{R} physical slots do not split evenly over {num_gpus} GPUs")
    if tuple(logcnt.shape) != (L, num_logical):
        raise PlacementError(f"logcnt must be [{L}, {num_logical}], got {tuple(logcnt.shape)}")
    if log2phy.dim() != 3 or tuple(log2phy.shape[:2]) != (L, num_logical):
        raise PlacementError(f"log2phy must be [{L}, {num_logical}, max_replicas], got {tuple(log2phy.shape)}")
    p2l = phy2log.long()
    out = (p2l < 0) | (p2l >= num_logical)
    if out.any():
        l, p = (int(i) for i in out.nonzero()[0])
        raise PlacementError(f"layer {l}: slot {p} on GPU {p // (R // num_gpus)} holds expert {int(p2l[l, p])}, "
                             f"outside [0, {num_logical}) (every GPU must fill all its {R // num_gpus} slots)")
    counts = torch.zeros(L, num_logical, dtype=torch.long).scatter_add_(1, p2l, torch.ones_like(p2l))
    missing = counts == 0
    if missing.any():
        l, e = (int(i) for i in missing.nonzero()[0])
        raise PlacementError(f"layer {l}: expert {e} has no replica ({int(missing.sum())} experts unplaced in total)")
    wrong = counts != logcnt.long()
    if wrong.any():
        l, e = (int(i) for i in wrong.nonzero()[0])
        raise PlacementError(f"layer {l}: logcnt says expert {e} has {int(logcnt[l, e])} replicas, "
                             f"phy2log holds {int(counts[l, e])}")
    from inferhal.core.eplb.placement import build_log2phy

    expect = build_log2phy(p2l, num_logical, log2phy.shape[2]) if counts.max() <= log2phy.shape[2] else None
    if expect is None:
        raise PlacementError(f"log2phy has room for {log2phy.shape[2]} replicas, an expert has {int(counts.max())}")
    diff = expect != log2phy.long()
    if diff.any():
        l, e, _ = (int(i) for i in diff.nonzero()[0])
        raise PlacementError(f"layer {l}: log2phy[{e}] = {log2phy[l, e].tolist()} does not list the slots holding "
                             f"expert {e} ({expect[l, e].tolist()})")
    if hierarchical is None:
        hierarchical = num_nodes > 1 and num_groups % num_nodes == 0
    if hierarchical and num_nodes > 1:
        if num_logical % num_groups or R % num_nodes:
            raise PlacementError(f"{num_logical} experts / {R} slots do not split into {num_groups} groups "
                                 f"on {num_nodes} nodes")
        node_of_slot = torch.arange(R) // (R // num_nodes)  # [R]
        group = p2l // (num_logical // num_groups)  # [L, R]
        lo = torch.full((L, num_groups), num_nodes, dtype=torch.long).scatter_reduce(
            1, group, node_of_slot.expand(L, R), "amin")
        hi = torch.full((L, num_groups), -1, dtype=torch.long).scatter_reduce(
            1, group, node_of_slot.expand(L, R), "amax")
        split = lo != hi
        if split.any():
            l, g = (int(i) for i in split.nonzero()[0])
            raise PlacementError(f"layer {l}: expert group {g} spans nodes {int(lo[l, g])}..{int(hi[l, g])}; "
                                 f"the hierarchical policy keeps each group within one node")
