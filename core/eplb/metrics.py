"""How good a placement is: per-GPU load, balancedness, and a lower bound no valid placement can beat.

Balancedness of a layer = max per-GPU load / mean per-GPU load (1.0 is perfect); reported as the mean
over layers. A replica's load is its expert's load divided by the expert's replica count (routing spreads
each expert's tokens evenly over its replicas).
"""

from __future__ import annotations

import torch

from inferhal.core.eplb.policy import replicate


def gpu_loads(weight: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """``[L, num_gpus]`` load per GPU of ``weight[L, E]`` under the placement."""
    per_replica = (weight.float() / logcnt.clamp(min=1)).gather(1, phy2log.long())  # [L, R]
    return per_replica.view(weight.shape[0], num_gpus, -1).sum(-1)


def balancedness_per_layer(weight: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor,
                           num_gpus: int) -> torch.Tensor:
    g = gpu_loads(weight, phy2log, logcnt, num_gpus)
    mean = g.mean(dim=1)
    return torch.where(mean > 0, g.amax(dim=1) / mean.clamp(min=1e-30), torch.ones_like(mean))


def balancedness(weight: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor, num_gpus: int) -> float:
    """Mean over layers of max/mean per-GPU load."""
    return float(balancedness_per_layer(weight, phy2log, logcnt, num_gpus).mean())


def lower_bound_per_layer(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                          num_gpus: int) -> torch.Tensor:
    """Per layer, a bound ``<=`` the balancedness of every valid placement with even replica splitting.

    max GPU load >= max(mean GPU load, m*) where m* is the smallest achievable largest per-replica load with
    ``num_replicas`` slots (D'Hondt is optimal for it; two replicas of one expert on one GPU act as one
    bigger replica). Hierarchical: a node carries whole groups, so max GPU load >= (heaviest node) / GPUs
    per node, and the heaviest node >= max(heaviest group, the two lightest of the ``num_nodes + 1``
    heaviest groups, which share a node by pigeonhole, when there are more groups than nodes).
    """
    w = weight.float()
    L, E = w.shape
    mean = w.sum(dim=1) / num_gpus
    phy2log, logcnt = replicate(w, num_replicas)
    bound = torch.maximum(mean, (w / logcnt).amax(dim=1))
    if num_groups % num_nodes == 0 and num_nodes > 1:
        groups = w.view(L, num_groups, E // num_groups).sum(-1).sort(dim=1, descending=True).values
        node = groups[:, 0]
        if num_groups > num_nodes:
            node = torch.maximum(node, groups[:, num_nodes - 1] + groups[:, num_nodes])
        bound = torch.maximum(bound, node / (num_gpus // num_nodes))
    return torch.where(mean > 0, bound / mean.clamp(min=1e-30), torch.ones_like(mean))


def lower_bound(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> float:
    return float(lower_bound_per_layer(weight, num_replicas, num_groups, num_nodes, num_gpus).mean())
