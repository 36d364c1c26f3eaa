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


def dispatch_combine(layout, out_dir):
    comm = TorchDistCommunicator(layout, timeout_s=60)
    g = torch.Generator().manual_seed(layout.rank)
    n, me = layout.world_size, layout.rank
    t = T + me  # uneven token counts per rank
    x = torch.randn(t, D, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    ids[torch.rand(t, K, generator=g) < 0.2] = -1
    w = torch.rand(t, K, generator=g)
    p = EPParams(ep_size=n, num_physical=E)
    scale = torch.randn(E // n, D, generator=torch.Generator().manual_seed(99)).to(torch.bfloat16)
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
    g = torch.Generator().manual_seed(10 + layout.rank)
    n, me = layout.world_size, layout.rank
    t = T - me
    x = torch.randn(t, D, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    ids[torch.rand(t, K, generator=g) < 0.2] = -1
    w = torch.rand(t, K, generator=g)
    p = EPParams(ep_size=n, num_physical=E)
    scale = torch.randn(E // n, D, generator=torch.Generator().manual_seed(99)).to(torch.bfloat16)

    def expert(sent):  # rows with local id -1 give zeros, as moe.experts skips them
        ok = sent.local_ids >= 0
        return torch.where(ok[:, None], sent.x * scale[sent.local_ids.clamp(min=0)], torch.zeros_like(sent.x))

    out, reads = {}, []
    sent = moe_dispatch(x, ids, comm, p, exchange="exact")
    out["exact"] = (sent.x, sent.local_ids, moe_combine(expert(sent), w, sent.handle, comm, p))
    guard = HostSyncGuard(backend_fatal=True)
    try:
        with guard:
            # uneven shards (T - rank tokens): every rank passes the same capacity, the largest shard's T x K
            sent = moe_dispatch(x, ids, comm, p, exchange="padded", capacity=T * K)
            y = moe_combine(expert(sent), w, sent.handle, comm, p)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
        reads.append(str(exc))
        raise
    ok = sent.local_ids >= 0
    out["padded"] = (sent.x[ok], sent.local_ids[ok], y)
    out["host_reads"] = reads
    torch.save(out, os.path.join(out_dir, f"rank{me}.pt"))
