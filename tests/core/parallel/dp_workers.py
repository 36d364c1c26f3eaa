"""Rank bodies for the DP attention × EP MoE tests (loaded by file in each spawned process), and the
scenarios both sides run: the test process runs each one in a single plain process, the ranks under DP."""

import contextlib
import io
import os

import torch
from omegaconf import OmegaConf

# shared prefixes (block_size 16): A* share 32 tokens, B* share 16; R repeats a pattern (n-gram drafts find it)
_A = [(7 * i + 3) % 190 + 1 for i in range(32)]
_B = [(11 * i + 5) % 190 + 1 for i in range(16)]
R = [5, 6, 7, 8, 9] * 7
PROMPTS = [[1, 2, 3, 4, 5], [7, 150, 33, 9, 81, 2, 64, 11, 5, 99, 120, 17, 3], [42],
           list(range(20, 41)), _A + [9, 9, 4], _B + [60, 61, 62, 63, 64, 65, 66], R, [100, 101, 102, 100, 101, 102] * 3]
# a later batch whose prefixes the first batch cached: load alone would send _A's and R's to rank 1 of dep2
SECOND = [[42, 43], _A + [3, 1, 4, 1, 5], _B + [77, 78], R[:20] + [1, 2]]
MAX_TOKENS = 7
CHUNK_NGRAM = ["scheduler.max_num_batched_tokens=12", "spec=ngram",
               "spec.num_speculative_tokens=3", "spec.disable_by_batch_size=0"]
# name -> (config overrides, prompt batches, sampling)
SCENARIOS = {
    # greedy requests and sampled ones (seeded and not), live EPLB every 2 steps (10 slots: 2 redundant): planned
    # in the background, then one MoE layer's weights move per step
    "plain": (["parallel=ep2", "eplb=default", "eplb.step_interval=2", "eplb.num_redundant_experts=2"], [PROMPTS],
              "mixed"),
    "features": (["cache.num_blocks=14", *CHUNK_NGRAM], [PROMPTS, SECOND], "greedy"),  # prefix hits, chunks, drafts
    "preempt": (["cache.num_blocks=5", *CHUNK_NGRAM], [PROMPTS], "greedy"),  # 5 blocks a group: preemption
    "lonely": ([], [[PROMPTS[1]]], "greedy"),  # one request: the other ranks never have a token
    # batch-invariant ops: the single process's logprobs bit for bit (its reference runs the mode too), through
    # preemption, chunks, drafts, prefix hits and sampling
    "deterministic": (["deterministic=true", "cache.num_blocks=5", *CHUNK_NGRAM], [PROMPTS, SECOND], "mixed"),
    # MTP drafts: their MoE layer runs on the ranks with drafts only, the others serve it empty
    "mtp": (["spec=mtp", "spec.num_speculative_tokens=2", "spec.disable_by_batch_size=0"], [PROMPTS[:3]], "greedy"),
}


def tiny_cfg(overrides=()):
    from inferhal.core.engine.llm import compose_config

    return compose_config("deepseek_v4_tiny", "reference", overrides=["cache.num_blocks=64", *overrides])


def params(kind, i):
    """Request ``i``'s sampling: greedy (``max_tokens`` varies, so ranks finish at different steps); in a
    ``mixed`` batch every third request samples, unseeded (the engine derives its seed from the arrival)
    or, for request 5, seeded."""
    from inferhal.core.sampling.params import SamplingParams

    if kind == "mixed" and i % 3 == 2:
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=20, ignore_eos=True, logprobs=1,
                              seed=123 if i == 5 else None)
    return SamplingParams(max_tokens=MAX_TOKENS + i % 3, temperature=0.0, ignore_eos=True, logprobs=1)


def run(llm, batches, kind):
    """Every batch to completion, one after the other: per request (tokens, logprobs of the tokens,
    cached prompt tokens, preemptions, drafts)."""
    res = []
    for batch in batches:
        outs = llm.generate(batch, [params(kind, i) for i in range(len(batch))])
        for o in outs:
            c = o.outputs[0]
            res.append({"tokens": list(c.token_ids), "logprobs": [lp[t] for lp, t in zip(c.logprobs, c.token_ids)],
                        "cached": o.num_cached_tokens, "preemptions": o.num_preemptions,
                        "drafts": o.num_draft_tokens})
    return res


def reference(name):
    """The scenario in one plain process (no parallel layout, none of the scenario's features but
    ``deterministic``): its outputs and the tokens its engine scheduled."""
    from inferhal.core.engine.llm import LLM

    over, batches, kind = SCENARIOS[name]
    llm = LLM.from_config(tiny_cfg([o for o in over if o == "deterministic=true"]))
    return run(llm, batches, kind), llm.engine.stats["tokens"]


def dp_llm(layout, overrides):
    from inferhal.core.engine.llm import LLM
    from inferhal.core.parallel.dp_engine import DPEngine, attach_dp

    cfg = tiny_cfg(overrides)
    llm = LLM.from_config(cfg)
    hook = attach_dp(llm.engine, llm.engine.backend.communicator(layout), cfg.eplb)
    llm.engine = DPEngine(llm.engine, hook)
    return llm, hook


def dp_suite(layout, out_dir, names):
    """Each scenario on this rank; saves its outputs, step log, placements and engine counters."""
    torch.set_num_threads(1)
    from inferhal.core.parallel.sync import RankDivergenceError

    me = layout.rank
    got = {}
    for name in names:
        over, batches, kind = SCENARIOS[name]
        llm, hook = dp_llm(layout, over)
        res = run(llm, batches, kind)
        eng = llm.engine.engine
        assert not llm.engine.owner  # forgotten once finished
        # request ids count up from 0 in arrival order, as the placements list them
        own = [str(i) for i, r in enumerate(r for pl in llm.engine.placements for r in pl) if r == me]
        got[name] = {"res": res, "log": [(s.step, s.attn_tokens, s.seqs, s.moe) for s in hook.log],
                     "placements": llm.engine.placements, "own": own, "tokens": eng.stats["tokens"],
                     "preemptions": eng.scheduler.num_preemptions, "drafts": eng.stats["draft_tokens"],
                     "rebalances": [(r.step, r.received) for r in hook.rebalances],
                     "started": [r.started for r in hook.rebalances],
                     "moves": [(m.step, m.layers) for m in hook.rebalancer.moves] if hook.rebalancer else []}
        if hook.controller is not None:  # what EPLB counted since its last rebalance: own and all-reduced
            rec = hook.controller.recorder
            got[name]["load"] = (int(rec.local_load().sum()), int(rec.window_load(hook.comm).sum()), rec.steps)
    # `inferhal generate parallel=dep2 prompts_file=...` as each spawned rank runs it (run_rank), in this group
    from inferhal.core.engine.llm import compose_config
    from inferhal.core.cli.generate import generate
    from inferhal.core.parallel.ep_generate import run_rank

    cfg = compose_config("deepseek_v4_tiny", "reference", overrides=[
        f"parallel.dp={layout.world_size}", f"parallel.ep={layout.world_size}", f"prompts_file={out_dir}/jobs.jsonl",
        "sampling.max_tokens=5", "sampling.temperature=0"])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        got["cli"] = {"rc": run_rank(layout, OmegaConf.to_container(cfg, resolve=True), generate)}
    torch.set_num_threads(1)
    got["cli"].update(stdout=out.getvalue(), stderr=err.getvalue())
    # a rank handed different requests is named on every rank, not left hanging
    llm, _ = dp_llm(layout, [])
    try:
        llm.generate([[1, 2, 3 + me]], params("greedy", 0))
        got["mismatch"] = "no error"
    except RankDivergenceError as exc:
        got["mismatch"] = str(exc)
    torch.save(got, os.path.join(out_dir, f"rank{me}.pt"))
    # a rank that exits: the others are told at their next collective, where, instead of hanging
    if me == 1:
        os._exit(0)
    try:
        llm.generate([[1, 2, 3], [4, 5]], params("greedy", 0))
        msg = "no error"
    except RankDivergenceError as exc:
        msg = str(exc)
    with open(os.path.join(out_dir, f"exit{me}.txt"), "w") as f:
        f.write(msg)
    os._exit(0)  # skip the process group's teardown (a peer is gone)

