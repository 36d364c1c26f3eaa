"""Rank bodies of the multi-process moe.dispatch / moe.combine kernel test (loaded by file in each spawned
process; the kernels run in Triton's interpreter there, the all-to-all on gloo)."""

import os

from inferhal.kernels.runtime import use_interpreter

use_interpreter(True)

import torch  # noqa: E402

from inferhal.backends.reference.comm import TorchDistCommunicator  # noqa: E402
from inferhal.backends.reference.ep import moe_combine as ref_combine, moe_dispatch as ref_dispatch  # noqa: E402
from inferhal.core.ops.params import EPParams  # noqa: E402
from inferhal.kernels.moe_ep import moe_combine, moe_dispatch  # noqa: E402

E, D, K, T = 8, 48, 3, 11


def _inputs(layout, seed: int, t: int):
    """This rank's t tokens (x, ids with 20 % skipped, weights), the EP params and a per-slot expert scale."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, D, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    ids[torch.rand(t, K, generator=g) < 0.2] = -1
    w = torch.rand(t, K, generator=g)
    n = layout.world_size
    scale = torch.randn(E // n, D, generator=torch.Generator().manual_seed(99)).to(torch.bfloat16)
    return x, ids, w, EPParams(ep_size=n, num_physical=E), scale


def dispatch_combine(layout, out_dir):
    comm = TorchDistCommunicator(layout, timeout_s=60)
    me = layout.rank
    x, ids, w, p, scale = _inputs(layout, me, T + me)  # uneven token counts per rank
    out = {}
    for name, disp, comb in (("kernel", moe_dispatch, moe_combine), ("reference", ref_dispatch, ref_combine)):
        sent = disp(x, ids, comm, p)
        y_local = sent.x * scale[sent.local_ids]  # a per-slot "expert" that does not depend on the order
        out[name] = (sent.x, sent.local_ids, comb(y_local, w, sent.handle, comm, p))
    torch.save(out, os.path.join(out_dir, f"rank{me}.pt"))


def padded_vs_exact(layout, out_dir):
    """The padded (capturable) exchange against the exact one on the same inputs, the padded one under the
    host-sync guard with backend reads fatal (gloo's all_to_all_single included)."""
    from inferhal.core.engine.host_sync import HostSyncGuard

    comm = TorchDistCommunicator(layout, timeout_s=60)
    me = layout.rank
    x, ids, w, p, scale = _inputs(layout, 10 + me, T - me)

    def expert(sent):  # rows with local id -1 give zeros, as moe.experts skips them
        ok = sent.local_ids >= 0
        return torch.where(ok[:, None], sent.x * scale[sent.local_ids.clamp(min=0)], torch.zeros_like(sent.x))

    out = {}
    sent = moe_dispatch(x, ids, comm, p, exchange="exact")
    out["exact"] = (sent.x, sent.local_ids, moe_combine(expert(sent), w, sent.handle, comm, p))
    with HostSyncGuard(backend_fatal=True):  # a host read raises here: the rank fails, and the test with it
        # uneven shards (T - rank tokens): every rank passes the same capacity, the largest shard's T x K
        sent = moe_dispatch(x, ids, comm, p, exchange="padded", capacity=T * K)
        y = moe_combine(expert(sent), w, sent.handle, comm, p)
    ok = sent.local_ids >= 0
    out["padded"] = (sent.x[ok], sent.local_ids[ok], y)
    torch.save(out, os.path.join(out_dir, f"rank{me}.pt"))
