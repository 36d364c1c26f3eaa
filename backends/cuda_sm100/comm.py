"""Communication on NCCL through torch.distributed (DeepEP as a later acceleration)."""

from __future__ import annotations

from inferhal.backends.reference.comm import SingleProcessCommunicator, TorchDistCommunicator
from inferhal.core.backend import ParallelLayout


def make_communicator(layout: ParallelLayout, interpret: bool):
    if layout.world_size == 1:
        return SingleProcessCommunicator(layout)
    # in the interpreter the tensors live on the CPU, so the collectives run on gloo
    return TorchDistCommunicator(layout, backend="gloo" if interpret else "nccl")
