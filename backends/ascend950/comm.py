"""Communication on HCCL through torch.distributed, and the HCCL group name MC2 operators address.

The collectives (all-reduce for TP, all-gather, variable all-to-all, barrier) are the reference
backend's :class:`TorchDistCommunicator` on one process group whose backend torch picks by the tensors'
device (:data:`BACKEND`): NPU tensors on ``hccl``, which torch_npu registers with torch.distributed for
device type ``npu`` (HCCL supports ``all_to_all_single``; the batched isend/irecv path the reference uses for
gloo also runs on HCCL), and CPU tensors on gloo. Core's host-side collectives all-gather CPU tensors (DP round
headers in core/parallel/dp_moe.py, ``StepSync``, the graph vote, ``gather_objects``), which HCCL cannot carry:
a group of ``hccl`` alone maps only ``npu`` and refuses them. ``world_size == 1`` needs no process group.

The EP acceleration, MC2 (``npu_moe_distribute_dispatch`` / ``npu_moe_distribute_combine``: the token
all-to-all fused with the expert grouping on the device), is the ``moe.dispatch`` / ``moe.combine`` ops
(:mod:`inferhal.backends.ascend950.ep`), which ``core/parallel/ep_moe.py`` calls through the op table. The
operators address the communicator by its HCCL name, which :func:`hccl_group_name` reads from the process
group (``ProcessGroupHCCL.get_hccl_comm_name(rank)``). Wired and contract-tested; never run here.
"""

from __future__ import annotations

from typing import Any

import torch

from inferhal.backends.reference.comm import SingleProcessCommunicator, TorchDistCommunicator
from inferhal.core.backend import ParallelLayout

#: the process group's backend per device type (torch.distributed's "device:backend,..." form, which torch's
#: BackendConfig parses for any registered device type; torch_npu registers "hccl" with devices=["npu"])
BACKEND = "cpu:gloo,npu:hccl"


def make_communicator(layout: ParallelLayout, timeout_s: float | None = None):
    """HCCL communicator for this rank (identities when ``world_size == 1``); the timeout is
    ``parallel.timeout_s`` (``layout.timeout_s``). HCCL's first collective builds its rings, which takes
    seconds on large jobs: raise it there if 120 s is short."""
    if layout.world_size == 1:
        return SingleProcessCommunicator(layout)
    return TorchDistCommunicator(layout, backend=BACKEND, timeout_s=timeout_s)


def hccl_group_name(group: Any, rank: int) -> str:
    """The HCCL communicator name MC2 operators take as ``group_ep`` (torch_npu's ProcessGroupHCCL): the
    group's backend for NPU tensors, the same object whether the group maps only ``npu`` or CPU tensors too."""
    backend = group._get_backend(torch.device("npu"))
    return backend.get_hccl_comm_name(rank)
