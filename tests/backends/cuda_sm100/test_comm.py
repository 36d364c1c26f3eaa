"""cuda_sm100's communicator: the process group it asks torch.distributed for carries core's host-side
collectives (CPU tensors) on gloo and the device exchanges (CUDA tensors) on NCCL; and each rank of a host
on its own GPU (backend.device_index + LOCAL_RANK), with torch.cuda and the driver query faked.

This torch has no NCCL (a CPU build): what runs here is the request to torch (init_process_group
monkeypatched) read through torch's own parser of device-mapped backend strings, and a real one-rank group
formed from the request's CPU half, on which core's host-side callers run. NCCL itself is wired, not run."""

import pytest
import torch
import torch.distributed as dist

from omegaconf import OmegaConf

from inferhal.backends.cuda_sm100 import comm as cuda_comm
from inferhal.backends.cuda_sm100 import device as cuda_device
from inferhal.backends.cuda_sm100 import plugin as cuda_plugin
from inferhal.backends.reference.comm import TorchDistCommunicator
from inferhal.core.backend import ParallelLayout
from inferhal.core.config.schema import ParallelConfig
from inferhal.core.errors import UserError
from inferhal.core.parallel import launch
from inferhal.core.parallel.dp_graphs import GraphPeers
from inferhal.core.parallel.launch import free_port
from inferhal.core.parallel.sync import StepSync, gather_objects

from dist_requests import device_map, record_groups  # tests/fixtures


def test_the_group_maps_cpu_tensors_to_gloo_and_cuda_tensors_to_nccl(monkeypatch):
    asked = record_groups(monkeypatch)
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
    experts.pass_layers, experts.graph_step = range(2), lambda rows, own: None
    assert GraphPeers(comm, graphs, experts).agree(3, True) == (4, True, 1)  # the graph vote
    assert [s[0] for s in spy.seen] == ["cpu"] * 4
    assert {s[2] for s in spy.seen} == {"ProcessGroupGloo"}


# ------------------------------------------------------------------ each rank of a host on its own GPU


class FakeGpus:
    """``count`` GPUs seen through torch.cuda and the driver query, with the indexes asked for and set."""

    def __init__(self, monkeypatch, count: int) -> None:
        self.count, self.queried, self.current = count, [], []
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: self.current.append(str(d)))
        monkeypatch.setattr(cuda_device, "query_device", self.query)
        monkeypatch.setattr(torch.version, "cuda", "13.0")  # the probe's CPU-build check

    def query(self, index: int = 0):
        if index >= self.count:
            raise RuntimeError(f"device_index {index} out of range")
        self.queried.append(index)
        return cuda_device.CudaDeviceInfo("NVIDIA H200", 9, 0, 141 * 10**9, 132, 13000)


@pytest.fixture
def host_env(monkeypatch):
    """No LOCAL_RANK / LOCAL_WORLD_SIZE / RANK here; whatever a test or a rank sets is undone afterwards."""
    for var in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(var, "0")
        monkeypatch.delenv(var)
    return monkeypatch


def rank_on_gpu(layout: ParallelLayout, seen: list, asked: list) -> None:
    """What a rank does with cuda_sm100 before it loads anything: profile, runtime device, communicator."""
    profile = cuda_device.device_profile(0)  # backend.device_index=0
    cuda_plugin.inferhal_device(profile)  # the selection's runtime device: this process's current GPU
    comm = cuda_plugin.inferhal_communicator(layout, profile)
    seen.append((layout.rank, layout.on_host(), profile.torch_device, str(comm.device), asked[-1][1]["rank"]))


def test_the_local_launchers_dep2_ranks_get_cuda0_and_cuda1(host_env, monkeypatch):
    gpus = FakeGpus(monkeypatch, 2)
    asked = record_groups(monkeypatch)
    monkeypatch.setattr(launch, "_exit_now", lambda: None)

    def in_process(entry, args, nprocs, join, start_method):  # the spawned ranks, one after another, here
        for i in range(nprocs):
            entry(i, *args)

    monkeypatch.setattr("torch.multiprocessing.start_processes", in_process)
    seen: list = []
    launch.launch(rank_on_gpu, OmegaConf.structured(ParallelConfig(ep=2, dp=2, master_port=0)), seen, asked)
    assert seen == [(0, (0, 2), "cuda:0", "cuda:0", 0), (1, (1, 2), "cuda:1", "cuda:1", 1)]
    assert gpus.queried == [0, 1] and gpus.current == ["cuda:0", "cuda:1"]  # set before any weight or KV page


def test_torchrun_local_rank_picks_the_gpu(host_env):
    gpus = FakeGpus(host_env, 4)
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.2",
           "MASTER_PORT": "29500"}
    parallel = OmegaConf.structured(ParallelConfig(ep=4, dp=4, launcher="torchrun"))
    layout = launch.layout_from_env(parallel, env)
    assert (layout.rank, layout.on_host()) == (3, (1, 2))  # rank 3 is the second of its host's two
    for var in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        host_env.setenv(var, env[var])
    assert cuda_device.device_profile(0).torch_device == "cuda:1"
    assert cuda_device.device_profile(2).torch_device == "cuda:3"  # backend.device_index=2: GPUs 2 and 3
    assert gpus.queried == [1, 3]


def test_a_single_process_keeps_backend_device_index(host_env):
    FakeGpus(host_env, 2)
    host_env.setattr(torch.cuda, "device_count", lambda: pytest.fail("a single process counted the host's GPUs"))
    assert cuda_device.device_profile(0).torch_device == "cuda:0"
    assert cuda_device.device_profile(1).torch_device == "cuda:1"  # backend.device_index, as before
    assert ParallelLayout().on_host() == (0, 1)


@pytest.mark.parametrize("have,base", [(1, 0), (2, 1)])
def test_fewer_gpus_than_ranks_on_the_host_is_a_user_error(host_env, have, base):
    FakeGpus(host_env, have)
    host_env.setenv("LOCAL_RANK", "0")
    host_env.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(UserError) as err:
        cuda_device.device_profile(base)
    msg = str(err.value)
    for field in ("LOCAL_WORLD_SIZE", "parallel.ep", f"backend.device_index={base}", f"CUDA reports {have}"):
        assert field in msg
    probe = cuda_device.probe(interpret=False, index=base)
    assert not probe.available and probe.reason == msg  # the rank's selection fails with it, no traceback


def test_a_world_without_local_rank_is_a_user_error(host_env):
    FakeGpus(host_env, 8)
    host_env.setenv("WORLD_SIZE", "4")  # RANK/WORLD_SIZE from a launcher that does not say the host's place
    with pytest.raises(UserError, match="WORLD_SIZE=4 is set but LOCAL_RANK is not"):
        cuda_device.device_profile(0)
