"""Rank bodies for the multi-process tests (loaded by file in each spawned process)."""

import os

import torch

from inferhal.backends.reference.comm import TorchDistCommunicator
from inferhal.backends.reference.ops import OPS
from inferhal.core.eplb import Placement, rebalance_experts
from inferhal.core.ops.params import EPParams, ExpertsParams
from inferhal.core.parallel.ep_moe import EPExperts
from inferhal.core.parallel.sync import RankDivergenceError, StepSync

E, D, I, K, T, L = 8, 16, 8, 2, 13, 2


def problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[:, 1] = (ids[:, 0] + 1 + torch.randint(0, E - 1, (T,), generator=g)) % E  # distinct choices
    w = torch.rand(T, K, generator=g)
    gu = torch.randn(L, E, 2 * I, D, generator=g) * 0.3
    down = torch.randn(L, E, D, I, generator=g) * 0.3
    return x, ids, w, gu, down


def _save(out_dir, rank, **tensors):
    torch.save(tensors, os.path.join(out_dir, f"rank{rank}.pt"))


def dispatch_combine(layout, out_dir):
    comm = TorchDistCommunicator(layout, timeout_s=30)
    x, ids, w, gu, down = problem()
    n, me = layout.world_size, layout.rank
    p = EPParams(ep_size=n, num_physical=E)
    s = E // n
    lo, hi = me * 7 // n, (me + 1) * 7 // n  # uneven token shards (some ranks may send nothing)
    sent = OPS["moe.dispatch"](x[lo:hi], ids[lo:hi], comm, p)
    assert bool((sent.local_ids < s).all())
    ones = torch.ones(sent.x.shape[0], 1)
    y_local = OPS["moe.experts"](sent.x, ones, sent.local_ids[:, None], gu[0, me * s:(me + 1) * s],
                                 down[0, me * s:(me + 1) * s], ExpertsParams())
    y = OPS["moe.combine"](y_local, w[lo:hi], sent.handle, comm, p)
    _save(out_dir, me, y=y, lo=torch.tensor(lo), hi=torch.tensor(hi))


def move_weights(layout, out_dir):
    from inferhal.core.eplb.transfer import apply_placement

    comm = TorchDistCommunicator(layout, timeout_s=30)
    n, me = layout.world_size, layout.rank
    R = 12
    old = Placement.identity(L, E, R)
    load = torch.tensor([[50.0, 1, 1, 1, 1, 1, 1, 30], [1.0, 40, 1, 1, 20, 1, 1, 1]])
    new = Placement(*rebalance_experts(load, R, 1, 1, n))
    s = R // n
    # tensor of slot p on layer l = its expert id (broadcast), so correctness is visible
    layers = [{"a": old.phy2log[l, me * s:(me + 1) * s].float()[:, None, None].expand(s, 3, 2).clone(),
               "b": old.phy2log[l, me * s:(me + 1) * s].to(torch.int32)[:, None] * 10} for l in range(L)]
    moved, received = apply_placement(layers, old.phy2log, new.phy2log, comm)
    _save(out_dir, me, a=torch.stack([m["a"] for m in moved]), b=torch.stack([m["b"] for m in moved]),
          expect=new.phy2log[:, me * s:(me + 1) * s], received=torch.tensor(received))


def ep_experts(layout, out_dir):
    comm = TorchDistCommunicator(layout, timeout_s=30)
    n, me = layout.world_size, layout.rank
    x, ids, w, gu, down = problem(1)
    R = 12
    full = [(gu[l], down[l]) for l in range(L)]
    runner = EPExperts(OPS, comm, Placement.identity(L, E, R), full, ExpertsParams(swiglu_limit=10.0))
    before = torch.stack([runner(l, x, w, ids) for l in range(L)])
    load = torch.tensor([[50.0, 1, 1, 1, 1, 1, 1, 30], [1.0, 40, 1, 1, 20, 1, 1, 1]])
    received = runner.rebalance(Placement(*rebalance_experts(load, R, 1, 1, n)))
    after = torch.stack([runner(l, x, w, ids) for l in range(L)])
    _save(out_dir, me, before=before, after=after, received=torch.tensor(received))


def diverge(layout, out_dir, mode):
    comm = TorchDistCommunicator(layout, timeout_s=5)
    sync = StepSync(comm)
    me = layout.rank
    msg = ""
    try:
        sync.check(1)
        if mode == "skip":
            sync.check(3 if me == 1 else 2)  # rank 1 skipped a step
        elif mode == "exit" and me == 1:
            os._exit(0)  # rank 1 disappears without a word
        else:
            sync.check(2)
        msg = "no error"
    except RankDivergenceError as exc:
        msg = str(exc)
    with open(os.path.join(out_dir, f"rank{me}.txt"), "w") as f:
        f.write(msg)
    os._exit(0)  # skip the process-group teardown (the peer may be gone)


#: DP rounds: per rank, the (layer, first token, last token) calls of one step, in its order. Rank 0 runs two
#: passes, rank 1 one pass with its layers in the other order (so the rounds must serialise them), ranks 2+
#: none (they only serve the others, with empty batches).
DP_CALLS = {0: [(0, 0, 5), (1, 0, 5), (0, 5, 7), (1, 5, 7)], 1: [(1, 7, 11), (0, 7, 11)]}


def dp_rounds(layout, out_dir):
    from inferhal.core.parallel.dp_moe import DPExperts

    comm = TorchDistCommunicator(layout, timeout_s=30)
    me = layout.rank
    x, ids, w, gu, down = problem(2)
    R = 12
    full = [(gu[l], down[l]) for l in range(L)]
    runner = DPExperts(OPS, comm, Placement.identity(L, E, R), full, ExpertsParams(swiglu_limit=10.0), x.dtype)
    ys = [runner(l, x[a:b], w[a:b], ids[a:b]) for l, a, b in DP_CALLS.get(me, [])]
    busy = runner.drain(1, unfinished=me == 1)
    traffic = runner.end_step()
    try:
        runner.drain(2 + (me == 0), unfinished=False)  # rank 0 counts one step more
        msg = "no error"
    except RankDivergenceError as exc:
        msg = str(exc)
    # the pass plan (a forward calls layers 0, 1 in order): one header per pass, not per layer
    planned = DPExperts(OPS, comm, Placement.identity(L, E, R), full, ExpertsParams(swiglu_limit=10.0), x.dtype,
                        pass_layers=(0, 1))
    calls = [c for c in DP_CALLS.get(me, []) if me == 0] or ([(0, 7, 11), (1, 7, 11)] if me == 1 else [])
    ys_plan = [planned(l, x[a:b], w[a:b], ids[a:b]) for l, a, b in calls]
    planned.drain(1, unfinished=False)
    plan = planned.end_step()
    _save(out_dir, me, ys=ys, busy=torch.tensor(busy), rounds=torch.tensor(traffic.rounds),
          empty=torch.tensor(traffic.empty_rounds), rows=torch.tensor(traffic.token_rows), msg=msg,
          ys_plan=ys_plan, calls_plan=calls, plan=torch.tensor([plan.rounds, plan.empty_rounds, plan.headers]))


def ep_suite(layout, out_dir):
    """The EP checks in one process group (one spawn per world size keeps the suite quick)."""
    for name, fn in (("dc", dispatch_combine), ("mv", move_weights), ("ep", ep_experts), ("dp", dp_rounds)):
        sub = os.path.join(out_dir, name)
        os.makedirs(sub, exist_ok=True)
        fn(layout, sub)
