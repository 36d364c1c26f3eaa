"""The greedy baseline: "replicate the heaviest, then pack".

Same structure and replica allocation as :func:`~inferhal.core.eplb.policy.rebalance_experts` (each extra
slot to the expert with the highest load per replica), but the replicas are packed by the greedy LPT
(heaviest replica to the lightest GPU with a free slot) and never refined -- the scheme of DeepSeek's
public EPLB, written here from its description, so that the benchmark compares packing quality.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from inferhal.core.eplb.packing import lpt_pack
from inferhal.core.eplb.policy import rebalance_experts, rebalance_with
from inferhal.core.eplb.validate import EplbInputError, check_drift
from inferhal.core.errors import UserError


def greedy_pack(weight: torch.Tensor, num_packs: int, floor: torch.Tensor | None = None):
    """:func:`lpt_pack` as a :data:`~inferhal.core.eplb.policy.PackFn` (the baseline never stops early)."""
    return lpt_pack(weight, num_packs)


def rebalance_greedy(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                     num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Baseline with :func:`rebalance_experts`'s signature and output semantics."""
    return rebalance_with(weight, num_replicas, num_groups, num_nodes, num_gpus, greedy_pack)


def rebalance_per_layer(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                        num_gpus: int, policy=rebalance_experts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``policy`` run one layer at a time in a Python loop (the speed reference; same results)."""
    outs = [policy(weight[l : l + 1], num_replicas, num_groups, num_nodes, num_gpus) for l in range(weight.shape[0])]
    return tuple(torch.cat(parts, dim=0) for parts in zip(*outs))  # type: ignore[return-value]


POLICIES = {"inferhal": rebalance_experts, "greedy": rebalance_greedy}


def policy_of(policy: str) -> Callable:
    """The rebalancing function named by ``eplb.policy``, or a UserError naming the field."""
    if policy not in POLICIES:
        raise UserError(f"eplb.policy={policy!r} is unknown; choose one of {', '.join(sorted(POLICIES))}")
    return POLICIES[policy]


def drift_of(drift: Any) -> float:
    """``eplb.drift`` (the ``inferhal`` policy's knob) as a float, or a UserError naming the field."""
    try:
        return check_drift(drift)
    except EplbInputError as exc:
        raise UserError(f"eplb.drift={drift!r}: {exc}") from None
