"""Communication on HCCL through torch.distributed (MC2 dispatch/combine as an acceleration)."""

from __future__ import annotations

from inferhal.backends.reference.comm import SingleProcessCommunicator, TorchDistCommunicator
from inferhal.core.backend import ParallelLayout


def make_communicator(layout: ParallelLayout):
    if layout.world_size == 1:
        return SingleProcessCommunicator(layout)
    return TorchDistCommunicator(layout, backend="hccl")
