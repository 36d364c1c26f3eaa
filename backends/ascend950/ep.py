"""``moe.dispatch`` / ``moe.combine`` on MC2 (``npu_moe_distribute_dispatch`` / ``_combine``): the EP all-to-all
fused with the expert grouping on the device, reached through the op table (a mixin of
:class:`~inferhal.backends.ascend950.ops.NpuOps`), so ``core/parallel/ep_moe.py`` uses it unchanged.

Mapping (torch-npu 2.13.0 schema; limits from the torch_npu API page of npu_moe_distribute_dispatch):

- slots are sharded evenly over the EP ranks (``EPParams``), which is MC2's ``expert_shard_type`` 0 with no
  shared-expert ranks: ``moe_expert_num`` = ``num_physical``, rank r owns slots [r S, (r+1) S);
- dispatch sends without routing weights; it returns ``expand_x`` grouped by local expert and the count per
  local expert (``expert_token_nums_type`` 1), so ``local_ids`` = each row's group; ``expand_x`` may hold
  more rows (its bound A) than the counts use: only the counted rows are handed on;
- a row whose choices are all -1 (an empty shard's filler row) is left out by ``x_active_mask``; a single -1
  choice goes to one of this rank's own slots and gets weight 0 at combine; so every rank takes the same
  path (a rank falling back alone would deadlock the collective);
- combine takes the dispatch's ``expand_idx``, ``ep_send_counts`` (dispatch output 5), ``tp_send_counts`` and
  ``expand_scales`` back, with the routing weights as ``expert_scales`` [T, K] fp32, and sums in the
  operator's order.

The choice between MC2 and the reference all-to-all depends only on values every rank shares (dtype,
hidden size, top-k, group), never on one rank's data; MC2's per-call token bound (BS <= 512 on A3) is a
contract precondition, not a fallback reason, since shards differ by a row between ranks. Open for the
first multi-rank hardware run (the fake emulates one EP rank only): ``global_bs`` 0 is what the docs allow
when every rank sends the same BS; ``core/parallel/ep_moe.py``'s last shard can be shorter, in which case the
operator may want ``global_bs`` = max BS x ``ep_world_size``. The HCCL group name comes from the communicator's process
group (``comm.hccl_group_name``); one process has no group, and falls back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from inferhal.backends.reference import ep as ref_ep
from inferhal.backends.ascend950.preconditions import HALF
from inferhal.core.ops.params import DispatchResult

MC2_MAX_HIDDEN = 7168
MC2_MAX_TOKENS = 512
MC2_MAX_TOPK = 8


@dataclass
class Mc2Handle:
    ids: torch.Tensor  # [T, K] int32 as sent (fillers redirected)
    skip: torch.Tensor  # [T, K] bool: filler choices, weight 0 at combine
    active: torch.Tensor  # [T] bool: rows sent (x_active_mask)
    expand_idx: torch.Tensor
    ep_send_counts: torch.Tensor
    tp_send_counts: torch.Tensor
    expand_scales: torch.Tensor | None
    rows: int  # expand_x's rows (A)
    group: str


def default_group_name(comm: Any) -> str | None:
    """The HCCL name MC2 addresses the EP group by, or None when the communicator has no process group."""
    group = getattr(comm, "group", None)
    if group is None or comm.layout.world_size == 1:
        return None
    from inferhal.backends.ascend950.comm import hccl_group_name

    return hccl_group_name(group, comm.layout.rank)


class EpOps:
    """MC2 wrappers; expects ``self.npu``, ``self._fallback`` and ``self.group_name``."""

    group_name: Callable[[Any], str | None] = staticmethod(default_group_name)

    def _mc2_unsupported(self, x: torch.Tensor, ids: torch.Tensor, group: str | None) -> str:
        if group is None:
            return "no HCCL process group (one process): MC2 needs an EP communicator"
        if x.dtype not in HALF:
            return f"dtype {x.dtype}: MC2 sends fp16/bf16"
        if x.shape[1] % 32 or x.shape[1] > MC2_MAX_HIDDEN:
            return f"hidden {x.shape[1]}: MC2 takes a multiple of 32 up to {MC2_MAX_HIDDEN}"
        if ids.shape[1] > MC2_MAX_TOPK:
            return f"top-k {ids.shape[1]}: MC2 takes K <= {MC2_MAX_TOPK}"
        return ""

    def moe_dispatch(self, x: torch.Tensor, ids: torch.Tensor, comm: Any, p) -> DispatchResult:
        # x: [T, D]; ids: [T, K] physical slots (-1 = skip)
        group = self.group_name(comm)
        why = self._mc2_unsupported(x, ids, group)  # never a per-rank quantity: ranks must agree
        if why:
            self._fallback("moe.dispatch", why)
            return ref_ep.moe_dispatch(x, ids, comm, p)
        rank = comm.layout.rank
        skip = ids < 0
        k = ids.shape[1]  # fillers: slots of this rank, distinct within a row when it has >= K slots
        fill = rank * p.slots_per_rank + torch.arange(k, device=ids.device) % p.slots_per_rank
        ids32 = torch.where(skip, fill[None, :].expand_as(ids), ids).to(torch.int32).contiguous()
        active = ~skip.all(dim=1)  # a row of fillers only (an empty shard) is not sent at all
        expand_x, _dyn, expand_idx, counts, ep_recv, tp_recv, expand_scales = self.npu.npu_moe_distribute_dispatch(
            x.contiguous(), ids32, group, p.ep_size, rank, p.num_physical, x_active_mask=active.contiguous(),
            quant_mode=0, global_bs=0, expert_token_nums_type=1)
        counts = counts.long()
        r = int(counts.sum())
        local = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts)
        handle = Mc2Handle(ids32, skip, active, expand_idx, ep_recv, tp_recv, expand_scales, int(expand_x.shape[0]), group)
        return DispatchResult(expand_x[:r], local, handle)

    def moe_combine(self, y_local: torch.Tensor, weights: torch.Tensor, handle, comm: Any, p) -> torch.Tensor:
        # y_local: [R, D] unweighted, in dispatch order; weights: [T, K] -> [T, D]
        if not isinstance(handle, Mc2Handle):  # dispatch fell back: so does combine (same decision on every rank)
            self._fallback("moe.combine", "its dispatch took the reference all-to-all")
            return ref_ep.moe_combine(y_local, weights, handle, comm, p)
        y = y_local
        if y.shape[0] < handle.rows:
            y = torch.cat((y, y.new_zeros(handle.rows - y.shape[0], y.shape[1])))
        w = torch.where(handle.skip, torch.zeros_like(weights, dtype=torch.float32), weights.float()).contiguous()
        return self.npu.npu_moe_distribute_combine(
            y.contiguous(), handle.ids, handle.expand_idx, handle.ep_send_counts, w, handle.group, p.ep_size,
            comm.layout.rank, p.num_physical, tp_send_counts=handle.tp_send_counts,
            x_active_mask=handle.active, expand_scales=handle.expand_scales, global_bs=0)
