"""Rank bodies for the two-batch overlap tests (loaded by file in each spawned process): every scenario runs
on the same ranks without and then with ``parallel.tbo``, and each rank saves both runs' outputs and step
logs, and which threads ran its all-to-alls."""

import os
import threading

import torch

# block_size 16; A* share 32 tokens (prefix hits on the rank that cached them)
_A = [(7 * i + 3) % 190 + 1 for i in range(32)]
PROMPTS = [[1, 2, 3, 4, 5], [7, 150, 33, 9, 81, 2, 64, 11, 5, 99, 120, 17, 3], [42], list(range(20, 41)),
           _A + [9, 9, 4], [5, 6, 7, 8, 9] * 7, [100, 101, 102, 100, 101, 102] * 3, _A + [3, 1, 4]]
CHUNK_NGRAM = ["scheduler.max_num_batched_tokens=12", "spec=ngram", "spec.num_speculative_tokens=3",
               "spec.disable_by_batch_size=0"]
# name -> (config overrides, prompts, sampling kind)
SCENARIOS = {
    # greedy and sampled (seeded and not) requests; chunked prefill, n-gram drafts, prefix hits; 10 expert
    # slots for 8 experts (2 redundant replicas: each token's replica depends on its row in the step), live
    # EPLB rebalances every 2 steps
    "mixed": (["eplb=default", "eplb.num_redundant_experts=2", "eplb.step_interval=2", *CHUNK_NGRAM],
              PROMPTS, "mixed"),
    # batch-invariant ops, through preemption (5 blocks a group), chunks and drafts
    "deterministic": (["deterministic=true", "cache.num_blocks=5", *CHUNK_NGRAM], PROMPTS, "mixed"),
    # MTP drafts: the MTP layer's rounds (one exchange each) between split passes
    "mtp": (["spec=mtp", "spec.num_speculative_tokens=2", "spec.disable_by_batch_size=0"], PROMPTS[:5], "greedy"),
    # rank 0 gets requests 0 and 2 (split), rank 1 request 1 (one batch: it brings it beside an empty
    # micro-batch), which ends early: rank 1 then serves rank 0's split passes empty
    "uneven": ([], PROMPTS[:3], "uneven"),
}


def tiny_cfg(overrides=()):
    from inferhal.core.engine.llm import compose_config

    return compose_config("deepseek_v4_tiny", "reference", overrides=["cache.num_blocks=64", *overrides])


def params(kind, i):
    from inferhal.core.sampling.params import SamplingParams

    if kind == "mixed" and i % 3 == 2:
        return SamplingParams(max_tokens=7, temperature=0.8, top_k=20, ignore_eos=True, logprobs=1,
                              seed=123 if i == 5 else None)
    if kind == "uneven":
        return SamplingParams(max_tokens=3 if i == 1 else 9, temperature=0.0, ignore_eos=True, logprobs=1)
    return SamplingParams(max_tokens=7 + i % 3, temperature=0.0, ignore_eos=True, logprobs=1)


def run(llm, prompts, kind):
    outs = llm.generate(prompts, [params(kind, i) for i in range(len(prompts))])
    return [{"tokens": list(o.outputs[0].token_ids),
             "logprobs": [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
             "cached": o.num_cached_tokens, "preemptions": o.num_preemptions, "drafts": o.num_draft_tokens}
            for o in outs]


def dp_llm(layout, overrides, tbo):
    """A DP rank as `inferhal generate parallel=dep2 parallel.tbo=...` builds it (ep_generate.dp_llm)."""
    from inferhal.core.parallel.ep_generate import dp_llm as make

    return make(tiny_cfg(["parallel=dep2", f"parallel.tbo={str(tbo).lower()}", *overrides]),
                layout)


def tbo_suite(layout, out_dir, names):
    """Each scenario without, then with two-batch overlap; saves outputs, step logs, scheduled splits and
    how many all-to-alls each thread ran (MoE exchanges, and EPLB's weight transfers between steps)."""
    torch.set_num_threads(1)
    got = {}
    for name in names:
        over, prompts, kind = SCENARIOS[name]
        for tbo in (False, True):
            llm, hook = dp_llm(layout, over, tbo)
            comm, threads = hook.comm, {}
            real = comm.all_to_all

            def spy(chunks, real=real, threads=threads):
                name = threading.current_thread().name
                threads[name] = threads.get(name, 0) + 1
                return real(chunks)

            comm.all_to_all = spy
            sched = llm.engine.engine.scheduler
            splits = []
            schedule = sched.schedule

            def spied_schedule(schedule=schedule, splits=splits):
                out = schedule()
                splits.append((tuple(s.num_new for s in out.seqs), out.micro_batches))
                return out

            sched.schedule = spied_schedule
            res = run(llm, prompts, kind)
            got[(name, tbo)] = {"res": res, "log": [(s.step, s.attn_tokens, s.seqs, s.moe) for s in hook.log],
                                "splits": splits, "threads": threads,
                                "preemptions": llm.engine.engine.scheduler.num_preemptions,
                                "rebalances": [(r.step, r.received) for r in hook.rebalances]}
    torch.save(got, os.path.join(out_dir, f"rank{layout.rank}.pt"))
