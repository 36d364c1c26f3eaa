"""Communication on NCCL through torch.distributed (DeepEP as a later acceleration); gloo in the interpreter.

The reference's :class:`TorchDistCommunicator` exchanges its all-to-all sizes and receive buffers on the CPU
(gloo). :class:`NcclCommunicator` keeps both on the GPU: the sizes through one ``all_to_all_single`` of
per-rank counts, the rows through one ``all_to_all_single`` with split sizes (NCCL's grouped send/recv).
The process group maps devices to backends (:data:`BACKEND`): CUDA tensors go over NCCL, CPU tensors over gloo.
Core's host-side collectives all-gather CPU tensors through ``comm.all_gather`` (DP round headers in
core/parallel/dp_moe.py, ``StepSync``, the graph vote in dp_graphs.py, ``gather_objects``), which NCCL cannot
carry; one group with torch's device-mapped backend string routes each collective by its tensors' device, so
every caller keeps using ``comm.group``. ``device`` is this rank's GPU (the profile's ``cuda:<backend.device_index +
LOCAL_RANK>``, already current: :class:`~.device.CudaDevice`), so no two ranks of a host share one, which NCCL
refuses. Wired, never run here: no GPU on the development machines (the
multi-rank check is device-only)."""

from __future__ import annotations

from typing import Sequence

import torch

from inferhal.backends.reference.comm import SingleProcessCommunicator, TorchDistCommunicator
from inferhal.core.backend import ParallelLayout


#: the process group's backend per device type (torch.distributed's "device:backend,..." form)
BACKEND = "cpu:gloo,cuda:nccl"


class NcclCommunicator(TorchDistCommunicator):
    def __init__(self, layout: ParallelLayout, device: str = "cuda", timeout_s: float | None = None) -> None:
        super().__init__(layout, backend=BACKEND, timeout_s=timeout_s)
        self.device = torch.device(device)

    def all_to_all(self, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Variable-size all-to-all along dim 0: chunk r goes to rank r; returns what each rank sent here."""
        import torch.distributed as dist

        n = self.layout.world_size
        if len(chunks) != n:
            raise ValueError(f"all_to_all needs {n} chunks, got {len(chunks)}")
        send = [int(c.shape[0]) for c in chunks]
        sizes = torch.tensor(send, dtype=torch.int64, device=self.device)
        got = torch.empty_like(sizes)
        dist.all_to_all_single(got, sizes, group=self.group)
        recv = got.tolist()
        inp = torch.cat([c.to(self.device) for c in chunks]).contiguous()
        out = torch.empty((sum(recv), *inp.shape[1:]), dtype=inp.dtype, device=self.device)
        dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send, group=self.group)
        return list(out.split(recv))


def make_communicator(layout: ParallelLayout, interpret: bool, device: str = "cuda"):
    if layout.world_size == 1:
        return SingleProcessCommunicator(layout)
    if interpret:  # the tensors live on the CPU: the collectives run on gloo
        return TorchDistCommunicator(layout, backend="gloo")
    return NcclCommunicator(layout, device)
