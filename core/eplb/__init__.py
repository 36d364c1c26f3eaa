"""Expert-parallel load balancing: recorder, policy, validation, triggers, placement application.

Entry points: :func:`rebalance_experts` (the policy, DeepSeek-compatible signature),
:class:`LoadRecorder` (fed by the MoE layer), :class:`EplbController` (one rank's loop) and
:func:`validate_placement`.
"""

from inferhal.core.eplb.controller import EplbController, EplbLayout, PlacementHolder
from inferhal.core.eplb.placement import Placement, build_log2phy
from inferhal.core.eplb.policy import rebalance_experts
from inferhal.core.eplb.recorder import ExpertLoadSink, LoadRecorder, logical_load
from inferhal.core.eplb.trigger import RebalanceTrigger
from inferhal.core.eplb.validate import EplbInputError, PlacementError, validate_placement

__all__ = [
    "EplbController", "EplbLayout", "PlacementHolder", "Placement", "build_log2phy", "rebalance_experts",
    "ExpertLoadSink", "LoadRecorder", "logical_load", "RebalanceTrigger", "EplbInputError", "PlacementError",
    "validate_placement",
]
