"""Communication on HCCL through torch.distributed, and MC2 dispatch/combine for expert parallelism.

The collectives (all-reduce for TP, all-gather, variable all-to-all, barrier) are the reference
backend's :class:`TorchDistCommunicator` on the ``hccl`` process-group backend that torch_npu
registers with torch.distributed (HCCL supports ``all_to_all_single``; the batched isend/irecv path the
reference uses for gloo also runs on HCCL). ``world_size == 1`` needs no process group.

:class:`Mc2Dispatcher` is the EP acceleration: ``npu_moe_distribute_dispatch`` /
``npu_moe_distribute_combine`` fuse the token all-to-all with the expert grouping on the device
("MC2"). They address the communicator by its HCCL name, which :func:`hccl_group_name` reads from the
process group (``ProcessGroupHCCL.get_hccl_comm_name(rank)``). Wired and contract-tested; never run here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from inferhal.backends.reference.comm import SingleProcessCommunicator, TorchDistCommunicator
from inferhal.core.backend import ParallelLayout

BACKEND = "hccl"


def make_communicator(layout: ParallelLayout, timeout_s: float | None = None):
    """HCCL communicator for this rank (identities when ``world_size == 1``); the timeout is
    ``parallel.timeout_s`` (``layout.timeout_s``). HCCL's first collective builds its rings, which takes
    seconds on large jobs: raise it there if 120 s is short."""
    if layout.world_size == 1:
        return SingleProcessCommunicator(layout)
    return TorchDistCommunicator(layout, backend=BACKEND, timeout_s=timeout_s)


def hccl_group_name(group: Any, rank: int) -> str:
    """The HCCL communicator name MC2 operators take as ``group_ep`` (torch_npu's ProcessGroupHCCL)."""
    backend = group._get_backend(torch.device("npu"))
    return backend.get_hccl_comm_name(rank)


@dataclass
class DispatchHandle:
    """What combine needs from dispatch (outputs 2, 4, 5 and 6 of npu_moe_distribute_dispatch)."""

    expert_ids: torch.Tensor  # [T, K] int32, as dispatched
    expand_idx: torch.Tensor
    ep_send_counts: torch.Tensor
    tp_send_counts: torch.Tensor
    expand_scales: torch.Tensor | None


@dataclass
class Dispatched:
    x: torch.Tensor  # [R, D] tokens received by this rank's experts, grouped by local expert
    expert_token_nums: torch.Tensor  # [E_local] int64 counts (expert_token_nums_type=1)
    dynamic_scales: torch.Tensor | None  # per-token scales when quant_mode=2 (dynamic int8)
    handle: DispatchHandle


class Mc2Dispatcher:
    """EP dispatch/combine through the MC2 operators, for one EP group.

    ``moe_expert_num`` is the global routed-expert count; experts are sharded evenly over
    ``ep_world_size`` ranks (expert_shard_type 0), no shared-expert ranks. Argument contract relied on
    (torch-npu 2.13.0 schema): ``x`` [T, D] bf16/fp16, ``expert_ids`` [T, K] int32, ``group_ep`` the HCCL
    name, ``global_bs`` 0 (= every rank sends the same T), ``expert_token_nums_type`` 1 (counts);
    combine takes the dispatch's ``expand_idx`` and ``ep_send_counts`` back with ``expert_scales``
    [T, K] fp32 routing weights and sums in the operator's fixed order.
    """

    def __init__(self, npu: Any, group_name: str, ep_world_size: int, ep_rank: int, moe_expert_num: int,
                 quant: bool = False) -> None:
        if moe_expert_num % ep_world_size:
            raise ValueError(f"moe_expert_num {moe_expert_num} must divide evenly over ep_world_size {ep_world_size}")
        self.npu, self.group_name = npu, group_name
        self.ep_world_size, self.ep_rank, self.moe_expert_num = ep_world_size, ep_rank, moe_expert_num
        self.quant_mode = 2 if quant else 0  # 2 = dynamic per-token int8 on the wire

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Dispatched:
        ids32 = ids.to(torch.int32).contiguous()
        out = self.npu.npu_moe_distribute_dispatch(
            x.contiguous(), ids32, self.group_name, self.ep_world_size, self.ep_rank, self.moe_expert_num,
            expert_scales=weights.float().contiguous(), quant_mode=self.quant_mode, global_bs=0,
            expert_token_nums_type=1)
        expand_x, dyn_scales, expand_idx, token_nums, ep_recv, tp_recv, expand_scales = out
        handle = DispatchHandle(ids32, expand_idx, ep_recv, tp_recv, expand_scales)
        return Dispatched(expand_x, token_nums, dyn_scales if self.quant_mode else None, handle)

    def combine(self, y_local: torch.Tensor, weights: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        return self.npu.npu_moe_distribute_combine(
            y_local.contiguous(), handle.expert_ids, handle.expand_idx, handle.ep_send_counts,
            weights.float().contiguous(), self.group_name, self.ep_world_size, self.ep_rank, self.moe_expert_num,
            tp_send_counts=handle.tp_send_counts, expand_scales=handle.expand_scales, global_bs=0)


def mc2_factory(npu: Any) -> Callable[..., Mc2Dispatcher]:
    """The ``"mc2"`` backend extra: ``factory(comm, moe_expert_num)`` → a dispatcher over comm's group."""

    def make(comm: Any, moe_expert_num: int, quant: bool = False) -> Mc2Dispatcher:
        layout = comm.layout
        name = hccl_group_name(comm.group, layout.rank)
        return Mc2Dispatcher(npu, name, layout.world_size, layout.rank, moe_expert_num, quant)

    return make
