"""ascend950's communicator and each rank's NPU, without torch_npu or an NPU.

The process group maps CPU tensors (core's host-side all-gathers) to gloo and NPU tensors to HCCL. What runs
here: the backend string read by torch's own parser; and, in a forked child (the rename is for the whole
process), a real one-rank group of that string after torch's privateuse1 device is named "npu" and a stand-in
for torch_npu's "hccl" (a gloo backend, registered for devices=["npu"] as torch_npu registers it) is
installed: torch hands CPU tensors to gloo and NPU ones to the stand-in, which hccl_group_name finds. HCCL and
torch_npu's own helper (it patches torch's group creation on torch 2.13) are wired, not run."""

from __future__ import annotations

import multiprocessing
import types

import pytest
import torch.distributed as dist

from inferhal.backends.ascend950 import comm as ascend_comm
from inferhal.backends.ascend950.device import Host, probe, query_profile
from inferhal.core.backend import ParallelLayout
from inferhal.core.errors import UserError
from inferhal.core.parallel.launch import free_port

from dist_requests import device_map, record_groups  # tests/fixtures


def test_the_group_maps_cpu_tensors_to_gloo_and_npu_tensors_to_hccl(monkeypatch):
    asked = record_groups(monkeypatch)
    comm = ascend_comm.make_communicator(ParallelLayout(world_size=2, rank=1, ep=2, dp=2, master_port=1234))
    (backend, kw), = asked
    assert device_map(backend) == {"cpu": "gloo", "npu": "hccl"}  # "hccl" alone maps only npu (torch_npu's devices)
    assert (kw["world_size"], kw["rank"]) == (2, 1) and comm.backend == backend  # reform() forms it again


def _child(conn, port: int) -> None:
    import torch

    out = {}
    try:
        torch.utils.rename_privateuse1_backend("npu")  # what torch_npu does at import
        made = []

        class StandIn(dist.ProcessGroupGloo):  # torch_npu's ProcessGroupHCCL is a c10d Backend too
            def get_hccl_comm_name(self, rank):
                return f"stand-in-hccl:{rank}"

        def create(store, rank, size, timeout):
            made.append(StandIn(store, rank, size, timeout))
            return made[-1]

        dist.Backend.register_backend("hccl", create, devices=["npu"])  # as torch_npu registers it
        dist.init_process_group(ascend_comm.BACKEND, init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
        group = dist.group.WORLD
        cpu = group._get_backend(torch.device("cpu"))
        out["cpu"] = type(cpu).__name__
        out["cpu_is_hccl"] = any(cpu is m for m in made)
        out["npu_is_hccl"] = group._get_backend(torch.device("npu")) is made[0]
        out["name"] = ascend_comm.hccl_group_name(group, 0)
        got = [torch.zeros(2, dtype=torch.int64)]
        dist.all_gather(got, torch.tensor([7, 1]), group=group)  # a host-side header: on gloo
        out["gathered"] = got[0].tolist()
        dist.destroy_process_group()
        # this rank's NPU: LOCAL_RANK=1 of 2 on a host of 2 NPUs -> npu:1, set as the current device
        npu = types.SimpleNamespace(device_count=lambda: 2, get_device_name=lambda i: "Ascend950PR_9589",
                                    set_device=lambda d: out.setdefault("set", str(d)))
        fake = types.SimpleNamespace(npu=npu)
        env = {"ASCEND_HOME_PATH": "/opt/cann", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
        profile = query_profile(0, Host(environ=env, import_torch_npu=lambda: fake))
        from inferhal.backends.ascend950.device import AscendDevice

        AscendDevice(profile, torch_npu=fake)
        out["device"] = profile.torch_device
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(exc).__name__}: {exc}"
    conn.send(out)
    conn.close()


def test_a_real_group_of_that_string_carries_cpu_on_gloo_and_finds_hccl():
    ctx = multiprocessing.get_context("fork")  # torch is imported already: a forked child starts at once
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(theirs, free_port()))
    proc.start()
    assert mine.poll(30), "the child answered nothing in 30 s"
    out = mine.recv()
    proc.join(10)
    assert "error" not in out, out["error"]
    assert out["cpu"] == "ProcessGroupGloo" and not out["cpu_is_hccl"]  # CPU tensors: gloo, not the HCCL backend
    assert out["npu_is_hccl"] and out["name"] == "stand-in-hccl:0"  # MC2's group name still comes from HCCL
    assert out["gathered"] == [7, 1]
    assert (out["device"], out["set"]) == ("npu:1", "npu:1")


def fake_torch_npu(count: int):
    npu = types.SimpleNamespace(device_count=lambda: count, get_device_name=lambda i: "Ascend950PR_9589")
    return types.SimpleNamespace(npu=npu)


def rank_host(count: int, local: str | None, here: str | None) -> Host:
    env = {"ASCEND_HOME_PATH": "/opt/cann"}
    env.update({k: v for k, v in (("LOCAL_RANK", local), ("LOCAL_WORLD_SIZE", here)) if v is not None})
    return Host(find_spec=lambda n: object(), device_nodes=lambda: ["/dev/davinci0"], environ=env,
                isdir=lambda p: False, import_torch_npu=lambda: fake_torch_npu(count))


def test_each_rank_of_a_host_probes_and_profiles_its_own_npu():
    assert query_profile(0, rank_host(8, None, None)).torch_device == "npu:0"  # one process: backend.device_index
    assert query_profile(0, rank_host(8, "3", "4")).torch_device == "npu:3"
    assert query_profile(4, rank_host(8, "3", "4")).torch_device == "npu:7"  # backend.device_index=4: NPUs 4..7
    assert "npu:3 is Ascend950PR" in probe(0, rank_host(8, "3", "4")).reason


def test_fewer_npus_than_ranks_on_the_host_is_a_user_error():
    pr = probe(0, rank_host(1, "0", "2"))
    assert not pr.available
    for field in ("LOCAL_WORLD_SIZE", "parallel.ep", "backend.device_index=0", "NPU reports 1"):
        assert field in pr.reason
    with pytest.raises(UserError, match="NPU reports 1"):
        query_profile(0, rank_host(1, "1", "2"))
