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
