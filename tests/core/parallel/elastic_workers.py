"""Rank bodies for the elastic EP test (loaded by file in each spawned process): three DP/EP ranks with
``eplb.survive_rank_loss``; rank 2 exits in the middle of a forward, ranks 0 and 1 re-form without it."""

import os

import torch

import by_file  # tests/core/parallel (the test puts it on the path of the spawned ranks too)

# 8 routed experts + 10 redundant = 18 slots, 6 a rank: every expert on two ranks (eplb.survive_rank_loss)
SURVIVE = ["parallel.dp=3", "parallel.ep=3", "eplb=default", "eplb.num_redundant_experts=10", "eplb.survive_rank_loss=true", "eplb.step_interval=0"]
DIE_AT = 14  # rank 2's 14th MoE exchange: step 4's second MoE layer, inside a forward


def survivors(layout, out_dir, port):
    """dep3 (18 slots): rank 2 dies, ranks 0 and 1 go on."""
    torch.set_num_threads(1)
    wk = by_file.load("dp_workers")
    from inferhal.core.eplb.survive import covered
    from inferhal.core.eplb.validate import PlacementError
    from inferhal.core.parallel.elastic import shrink, survivor_layout
    from inferhal.core.parallel.sync import RankDivergenceError

    me = layout.rank
    llm, hook = wk.dp_llm(layout, SURVIVE)
    runner = hook.runner
    before = runner.placement
    if me == 2:
        calls = [0]
        steps = runner._steps

        def dying(*a, **kw):
            calls[0] += 1
            if calls[0] == DIE_AT:
                os._exit(0)
            return steps(*a, **kw)

        runner._steps = dying
    got = {"covered": [covered(before, 3, [r]) for r in range(3)]}
    dpe = llm.engine  # driven as the server's rank loop drives it: no generate() cleaning up after the error
    for i, p in enumerate(wk.PROMPTS):
        dpe.add_request(p, wk.params("greedy", i))
    try:
        while dpe.has_unfinished():
            dpe.step()
        got["failed"] = "no error"
    except RankDivergenceError as exc:
        got["failed"] = str(exc)
    kv = dpe.engine.kv_manager
    free = kv.num_free_blocks()
    got["held"] = (len(dpe.engine.scheduler.requests), sum(nb - free[g] for g, nb in kv.num_blocks.items()))
    got["shrink"] = shrink(llm.engine, [2], survivor_layout(layout, [2], "127.0.0.1", port))
    free = kv.num_free_blocks()
    got["kv_after"] = (sum(nb - free[g] for g, nb in kv.num_blocks.items()), len(kv.reqs))
    got["placement"] = (before.phy2log.clone(), runner.placement.phy2log.clone(), runner.ep_p.ep_size)
    try:  # a second loss: 12 slots cannot hold every expert twice, so losing the other rank is not covered
        other = 1 - llm.engine.comm.layout.rank
        shrink(llm.engine, [other], survivor_layout(llm.engine.comm.layout, [other], "127.0.0.1", port + 1))
        got["second"] = "no error"
    except PlacementError as exc:
        got["second"] = str(exc)
    got["res"] = wk.run(llm, [wk.PROMPTS], "greedy")
    got["after"] = wk.run(llm, [wk.SECOND], "greedy")
    got["log"] = [(s.step, s.attn_tokens) for s in hook.log]
    torch.save(got, os.path.join(out_dir, f"rank{me}.pt"))
    os._exit(0)  # skip the teardown (the first group's peer is gone)


def last_survivor(layout, out_dir, port):
    """dep2 with 16 slots (every expert on both ranks): rank 1 dies, rank 0 goes on alone in a group of one."""
    torch.set_num_threads(1)
    wk = by_file.load("dp_workers")
    from inferhal.core.parallel.elastic import shrink, survivor_layout
    from inferhal.core.parallel.sync import RankDivergenceError

    over = ["parallel=dep2", "eplb=default", "eplb.num_redundant_experts=8", "eplb.survive_rank_loss=true",
            "eplb.step_interval=0"]
    llm, hook = wk.dp_llm(layout, over)
    if layout.rank == 1:
        steps, calls = hook.runner._steps, [0]

        def dying(*a, **kw):
            calls[0] += 1
            if calls[0] == 10:
                os._exit(0)
            return steps(*a, **kw)

        hook.runner._steps = dying
    dpe = llm.engine
    for i, p in enumerate(wk.PROMPTS):
        dpe.add_request(p, wk.params("greedy", i))
    got = {}
    try:
        while dpe.has_unfinished():
            dpe.step()
    except RankDivergenceError as exc:
        got["failed"] = str(exc)
    got["shrink"] = shrink(dpe, [1], survivor_layout(layout, [1], "127.0.0.1", port))
    got["res"] = wk.run(llm, [wk.PROMPTS], "greedy")
    torch.save(got, os.path.join(out_dir, "alone.pt"))
    os._exit(0)
