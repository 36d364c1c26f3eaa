"""cuda_sm100's communicator: the process group it asks torch.distributed for carries core's host-side
collectives (CPU tensors) on gloo and the device exchanges (CUDA tensors) on NCCL.

This torch has no NCCL (a CPU build): what runs here is the request to torch (init_process_group
monkeypatched) read through torch's own parser of device-mapped backend strings, and a real one-rank group
formed from the request's CPU half, on which core's host-side callers run. NCCL itself is wired, not run."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig

from inferhal.backends.cuda_sm100 import comm as cuda_comm
from inferhal.backends.reference.comm import TorchDistCommunicator
from inferhal.core.backend import ParallelLayout
from inferhal.core.parallel.dp_graphs import GraphPeers
from inferhal.core.parallel.launch import free_port
from inferhal.core.parallel.sync import StepSync, gather_objects


def device_map(backend: str) -> dict[str, str]:
    """device type -> backend name, as torch.distributed reads ``backend`` in init_process_group."""
    return dict(BackendConfig(dist.Backend(backend)).get_device_backend_map())


def test_the_group_maps_cpu_tensors_to_gloo_and_cuda_tensors_to_nccl(monkeypatch):
    asked = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: asked.append((backend, kw)))
    layout = ParallelLayout(world_size=2, rank=1, ep=2, dp=2, master_port=1234)
    comm = cuda_comm.make_communicator(layout, interpret=False)
    assert isinstance(comm, cuda_comm.NcclCommunicator)
    (backend, kw), = asked
    assert device_map(backend) == {"cpu": "gloo", "cuda": "nccl"}  # "nccl" alone maps only cuda
    assert (kw["world_size"], kw["rank"], kw["init_method"]) == (2, 1, "tcp://127.0.0.1:1234")
    assert comm.backend == backend  # what reform() forms again after a rank's death
    asked.clear()
    assert type(cuda_comm.make_communicator(layout, interpret=True)) is TorchDistCommunicator
    assert asked[0][0] == "gloo"  # the interpreter: every tensor on the CPU


class Spy:
    """dist.all_gather that records which of the group's backends torch picks for the tensor's device, then
    answers as if every peer sent the same tensor (a one-rank group cannot gather two)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, torch.dtype, str]] = []

    def __call__(self, out, x, group=None, async_op=False):
        self.seen.append((x.device.type, x.dtype, type(group._get_backend(x.device)).__name__))
        for o in out:
            o.copy_(x)


@pytest.fixture
def cpu_half_group(monkeypatch):
    """A real one-rank process group formed from the CPU entry of whatever backend the communicator asks
    for (NCCL is not built into this torch); destroyed afterwards."""
    assert not dist.is_initialized()
    real = dist.init_process_group
    asked = []

    def init(backend, **kw):
        asked.append(backend)
        cpu = device_map(backend).get("cpu")
        if cpu is None:
            pytest.fail(f"the communicator asked for {backend!r}: no backend for CPU tensors")
        real(f"cpu:{cpu}", **{**kw, "init_method": f"tcp://127.0.0.1:{free_port()}", "world_size": 1, "rank": 0})

    monkeypatch.setattr(dist, "init_process_group", init)
    yield asked
    if dist.is_initialized():
        dist.destroy_process_group()


def test_host_side_collectives_run_on_gloo(cpu_half_group, monkeypatch):
    comm = cuda_comm.NcclCommunicator(ParallelLayout(world_size=2, rank=0, ep=2, dp=2, timeout_s=10))
    assert cpu_half_group == [cuda_comm.BACKEND]
    assert comm.group is dist.group.WORLD
    assert type(comm.group._get_backend(torch.device("cpu"))).__name__ == "ProcessGroupGloo"
    spy = Spy()
    monkeypatch.setattr(dist, "all_gather", spy)
    assert StepSync(comm).check(7, done=True) is True  # the per-step header
    assert gather_objects(comm, {"rank": 0, "tokens": [1, 2]}) == [{"rank": 0, "tokens": [1, 2]}] * 2  # 2 gathers
    graphs, experts = type("G", (), {"bucket": lambda self, n: 4})(), type("E", (), {})()
    experts.pass_layers, experts.graph_step = True, lambda size, rows: None
    assert GraphPeers(comm, graphs, experts).agree(3, True) == (4, True)  # the graph vote
    assert [s[0] for s in spy.seen] == ["cpu"] * 4
    assert {s[2] for s in spy.seen} == {"ProcessGroupGloo"}
