"""moe.dispatch / moe.combine kernels (kernels/moe_ep.py) in the interpreter vs the reference.

One rank: the communicator's collectives are identities, the kernels' bookkeeping is real: the received rows
and local ids equal the reference's in the same order (both group by destination rank, then (t, k)), and the
combine sums the same K values per token (fp32, k = 0..K-1, one rounding: equal bits). Two ranks on gloo:
both the kernel path and the reference path exchange through the same communicator in each rank.
"""

import os

import pytest
import torch

from inferhal.backends.reference.comm import SingleProcessCommunicator
from inferhal.backends.reference.ep import moe_combine as ref_combine, moe_dispatch as ref_dispatch
from inferhal.core.backend import ParallelLayout
from inferhal.core.ops.params import EPParams
from inferhal.core.parallel.launch import spawn_from_file
from inferhal.kernels.moe_ep import moe_combine, moe_dispatch

WORKERS = os.path.join(os.path.dirname(__file__), "ep_workers.py")


@pytest.mark.parametrize("t,d,k,e,skip", [(16, 64, 2, 8, 0.0), (9, 128, 6, 32, 0.2), (0, 32, 2, 4, 0.0), (300, 16, 2, 8, 0.5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_rank_equals_reference(t, d, k, e, skip, dtype):
    g = torch.Generator().manual_seed(t + k)
    x = torch.randn(t, d, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k, dtype=torch.long)
    ids[torch.rand(t, k, generator=g) < skip] = -1
    w = torch.rand(t, k, generator=g)
    comm = SingleProcessCommunicator(ParallelLayout())
    p = EPParams(ep_size=1, num_physical=e)
    got, want = moe_dispatch(x, ids, comm, p), ref_dispatch(x, ids, comm, p)
    assert torch.equal(got.x, want.x) and torch.equal(got.local_ids, want.local_ids)
    scale = torch.randn(e, d, generator=g).to(dtype)
    y = moe_combine(got.x * scale[got.local_ids], w, got.handle, comm, p)
    assert torch.equal(y, ref_combine(want.x * scale[want.local_ids], w, want.handle, comm, p))


def test_two_ranks_on_gloo_equal_reference(tmp_path):
    spawn_from_file(WORKERS, "dispatch_combine", 2, str(tmp_path))
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt")
        for got, want in zip(res["kernel"], res["reference"]):
            assert torch.equal(got, want)


def _experts(sent, scale):
    """A per-slot "expert" (the same math for a row whatever its place); rows with local id -1 give zeros, as
    moe.experts skips them."""
    ok = sent.local_ids >= 0
    return torch.where(ok[:, None], sent.x * scale[sent.local_ids.clamp(min=0)], torch.zeros_like(sent.x))


@pytest.mark.parametrize("t,d,k,e,skip", [(16, 64, 2, 8, 0.0), (9, 128, 6, 32, 0.2), (300, 16, 2, 8, 0.5)])
def test_padded_exchange_equals_exact_one_rank(t, d, k, e, skip):
    """The capturable layout: each rank's block of T*K places, the routed rows in the exact layout's order and
    the rest -1 / zeros; combine's output equal to the exact exchange's, bit for bit."""
    g = torch.Generator().manual_seed(3 * t + k)
    x = torch.randn(t, d, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[torch.rand(t, k, generator=g) < skip] = -1
    w = torch.rand(t, k, generator=g)
    comm = SingleProcessCommunicator(ParallelLayout())
    p = EPParams(ep_size=1, num_physical=e)
    exact, padded = moe_dispatch(x, ids, comm, p, exchange="exact"), moe_dispatch(x, ids, comm, p, exchange="padded")
    assert padded.x.shape == (t * k, d) and padded.handle.capacity == t * k
    ok = padded.local_ids >= 0
    assert torch.equal(padded.x[ok], exact.x) and torch.equal(padded.local_ids[ok], exact.local_ids)
    assert not padded.x[~ok].any() and int(ok.sum()) == exact.x.shape[0]
    scale = torch.randn(e, d, generator=g).to(torch.bfloat16)
    assert torch.equal(moe_combine(_experts(padded, scale), w, padded.handle, comm, p),
                       moe_combine(_experts(exact, scale), w, exact.handle, comm, p))


def test_padded_capacity_bound_and_id_range_are_device_checks():
    comm = SingleProcessCommunicator(ParallelLayout())
    x, ids = torch.randn(4, 8), torch.tensor([[0, 1], [0, 2], [0, 3], [1, 2]])
    p = EPParams(ep_size=1, num_physical=4)
    sent = moe_dispatch(x, ids, comm, p, exchange="padded", capacity=8)
    assert sent.x.shape == (8, 8) and int((sent.local_ids >= 0).sum()) == 8
    with pytest.raises(ValueError, match="more pairs than capacity=6"):  # 8 pairs for one rank
        moe_dispatch(x, ids, comm, p, exchange="padded", capacity=6)
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        moe_dispatch(x, ids + 1, comm, p, exchange="padded")
    with pytest.raises(ValueError, match="exchange='nccl'"):
        moe_dispatch(x, ids, comm, p, exchange="nccl")
    assert moe_dispatch(x, ids, comm, p).handle.capacity == 0  # auto on the CPU: exact


def test_padded_exchange_reads_nothing_on_the_host():
    """Under the guard with backend reads fatal: the padded dispatch and its combine (one rank; the two-rank
    run below checks the gloo exchange too); the exact one reads its split sizes (the guard sees them)."""
    from inferhal.core.engine.host_sync import HostSyncGuard, HostSyncError

    g = torch.Generator().manual_seed(0)
    x, ids, w = torch.randn(6, 16, generator=g), torch.randint(-1, 8, (6, 2), generator=g), torch.rand(6, 2, generator=g)
    comm, p = SingleProcessCommunicator(ParallelLayout()), EPParams(ep_size=1, num_physical=8)
    with HostSyncGuard(backend_fatal=True):
        sent = moe_dispatch(x, ids, comm, p, exchange="padded")
        moe_combine(sent.x * 2, w, sent.handle, comm, p)
    with pytest.raises(HostSyncError), HostSyncGuard(backend_fatal=True):
        moe_dispatch(x, ids, comm, p, exchange="exact")


def test_two_ranks_on_gloo_padded_equals_exact_without_host_reads(tmp_path):
    spawn_from_file(WORKERS, "padded_vs_exact", 2, str(tmp_path))
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt")  # written after the padded calls ran under the guard
        assert torch.equal(res["padded"][0], res["exact"][0])  # the routed rows, in order
        assert torch.equal(res["padded"][1], res["exact"][1])  # their local ids
        assert torch.equal(res["padded"][2], res["exact"][2])  # combine's output
