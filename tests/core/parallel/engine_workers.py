"""Rank bodies for the multi-process engine tests (loaded by file in each spawned process)."""

import os

import torch

PROMPTS = [[1, 2, 3, 4, 5], [7, 150, 33, 9, 81, 2, 64, 11, 5, 99, 120, 17, 3], [42]]
MAX_TOKENS = 6


def tiny_cfg(overrides=()):
    from inferhal.core.engine.llm import compose_config

    return compose_config("deepseek_v4_tiny", "reference", overrides=["cache.num_blocks=64", *overrides])


def greedy(llm):
    from inferhal.core.sampling.params import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def engine_suite(layout, out_dir, eplb_overrides, force_at, check_divergence):
    """Phase 1: generate with a forced rebalance at engine step ``force_at``; phase 2: generate again under
    the new placement; then (``check_divergence``) a rank that skips a step and a rank that dies."""
    torch.set_num_threads(1)
    from inferhal.core.parallel.ep_generate import ep_llm
    from inferhal.core.parallel.sync import RankDivergenceError

    me = layout.rank
    llm, ep = ep_llm(tiny_cfg([f"parallel.ep={layout.world_size}", "eplb=default", *eplb_overrides]), layout)

    def force(engine):
        if ep.step + 1 == force_at:
            ep.request_rebalance()

    llm.engine.step_hooks.insert(0, force)
    res = {"during": greedy(llm)}
    llm.engine.step_hooks.remove(force)
    res["after"] = greedy(llm)
    res["rebalances"] = [(r.step, r.old.phy2log, r.new.phy2log, r.received) for r in ep.rebalances]
    res["placement"] = ep.runner.placement.phy2log
    res["started"] = [r.started for r in ep.rebalances]
    res["moves"] = [(m.step, m.layers) for m in ep.rebalancer.moves]
    res["num_steps"] = ep.step
    torch.save(res, os.path.join(out_dir, f"rank{me}.pt"))
    if not check_divergence:
        return
    msgs = {}
    ep.step = 1 if me == 1 else 0  # rank 1 believes it has run one step more
    try:
        greedy(llm)
        msgs["skip"] = "no error"
    except RankDivergenceError as exc:
        msgs["skip"] = str(exc)
    ep.step = 0

    def die(engine):
        if ep.step + 1 == 2:
            raise RuntimeError("rank 1 fails before reaching step 2")

    if me == 1:
        llm.engine.step_hooks.insert(0, die)
    try:
        greedy(llm)
        msgs["exit"] = "no error"
    except RankDivergenceError as exc:
        msgs["exit"] = str(exc)
    except RuntimeError as exc:
        msgs["exit"] = f"raised: {exc}"
    with open(os.path.join(out_dir, f"rank{me}.txt"), "w") as f:
        f.write(repr(msgs))
    os._exit(0)  # skip the process-group teardown (the peer is gone)


def deterministic_suite(layout, out_dir):
    """The DP tests' ``deterministic`` scenario (batch-invariant ops; mixed greedy and sampled requests through
    preemption, chunked prefill, n-gram drafts and prefix hits) on plain EP ranks: every rank runs the whole
    batch, the routed experts are sharded. Saves this rank's outputs and engine counters."""
    torch.set_num_threads(1)
    import importlib.util

    from inferhal.core.parallel.ep_generate import ep_llm

    spec = importlib.util.spec_from_file_location("dp_workers", os.path.join(os.path.dirname(__file__), "dp_workers.py"))
    dp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dp)
    over, batches, kind = dp.SCENARIOS["deterministic"]
    out = {}
    # 5 blocks a group (preemption), then 14 (the second batch hits the first one's prefixes)
    for name, blocks in (("preempt", "cache.num_blocks=5"), ("prefix", "cache.num_blocks=14")):
        llm, ep = ep_llm(dp.tiny_cfg([f"parallel.ep={layout.world_size}", *over, blocks]), layout)
        eng = llm.engine
        out[name] = {"res": dp.run(llm, batches, kind), "preemptions": eng.scheduler.num_preemptions,
                     "drafts": eng.stats["draft_tokens"], "steps": ep.step}
    torch.save(out, os.path.join(out_dir, f"rank{layout.rank}.pt"))
