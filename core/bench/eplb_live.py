"""``inferhal bench eplb_live model=deepseek_v4_tiny``: how long a step waits while EPLB moves expert weights,
stop-the-world against live (:mod:`inferhal.core.parallel.rebalance`), in one spawned dep2 group.

The tiny V4's experts are widened (``model.arch.moe_intermediate_size``, ``bench_moe_intermediate`` below, with
16 routed experts and 4 redundant slots) so that one layer's transfer is worth measuring against a step; the
weights stay random and the outputs are compared, not judged. Each rank generates the same greedy prompts
``bench.repeats`` times per mode, alternating the modes (after ``bench.warmup`` untimed runs), with a
rebalance forced every ``REBALANCE_EVERY`` steps (``eplb.step_interval``). Per mode, over every timed step of
both ranks: the median step that moved no weights, the longest step and the median step among those that
moved weights, the weights' seconds per rebalance, and (live) how many steps a rebalance spanned from its
trigger to its last layer. The ranks and the single process run ``deterministic=true`` (batch-invariant ops):
outputs must equal, bit for bit, a single process without EPLB in both modes, and the exit status says so.
(Without the mode, dep2 agrees with one process to ~1e-6 in the logprobs, and EPLB's choice of replica
changes which rows an expert's product groups: with the widened random weights a near-tie can then flip a
greedy token, in both modes alike, which says nothing about weight moves.)

On a 2-core host the two ranks share the cores with each other and gloo's threads: the ratios within this run
are the result, not the absolute times; and the background plan competes with the ranks for the same cores,
which a GPU host does not have.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile

from inferhal.core.bench import write_json

REBALANCE_EVERY = 6
MODES = {"stop-the-world": 0, "live": 1}
WIDE = {"model.arch.moe_intermediate_size": 4096, "model.arch.n_routed_experts": 16, "eplb.num_redundant_experts": 4}


def prompts_of(n: int, vocab: int) -> list[list[int]]:
    # routing skewed towards a few experts: prompts made of a handful of tokens repeated
    return [[(3 + (i * 5 + j * j) % 11) % (vocab - 3) + 3 for j in range(10 + (7 * i) % 17)] for i in range(n)]


def rank_body(layout, cfg_dict: dict, prompts: list, max_tokens: int, repeats: int, warmup: int,
              out_dir: str) -> None:
    """One dep2 rank: each mode ``warmup + repeats`` times, alternating; per run the step times, which steps
    moved weights (and their seconds), the rebalances' start and end steps, and the tokens."""
    import torch
    from omegaconf import OmegaConf

    from inferhal.core.bench.ep import time_steps
    from inferhal.core.parallel.ep_generate import dp_llm
    from inferhal.core.sampling.params import SamplingParams

    torch.set_num_threads(1)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    runs = []
    order = [m for _ in range(warmup + repeats) for m in MODES]
    for i, mode in enumerate(order):
        d = dict(cfg_dict, eplb=dict(cfg_dict["eplb"], layers_per_step=MODES[mode]))
        llm, hook = dp_llm(OmegaConf.create(d), layout)
        times = time_steps(llm.engine)
        outs = llm.generate(prompts, sp)
        rb = hook.rebalancer
        if i >= 2 * warmup:
            runs.append({"mode": mode, "step_s": times, "moves": [(m.step, len(m.layers), m.seconds) for m in rb.moves],
                         "rebalances": [(r.started, r.step, r.received) for r in rb.rebalances],
                         "tokens": [list(o.outputs[0].token_ids) for o in outs]})
    with open(os.path.join(out_dir, f"rank{layout.rank}.json"), "w") as f:
        json.dump(runs, f)
    import torch.distributed as dist

    dist.barrier()


def summarize(ranks: list[list[dict]], want: list) -> dict:
    """Per mode (ms): the median step without weight moves, the median and longest step with one, the weights'
    seconds per rebalance, the rebalances completed and the steps each spanned; outputs equal ``want``."""
    med = statistics.median
    out: dict = {"equal": all(r["tokens"] == want for runs in ranks for r in runs)}
    for mode in MODES:
        runs = [r for rk in ranks for r in rk if r["mode"] == mode]
        normal, moving, per_rb, spans, layers = [], [], [], [], []
        for r in runs:
            moved = {s: (n, sec) for s, n, sec in r["moves"]}
            for s, t in enumerate(r["step_s"], start=1):  # the hook's step counter starts at 1
                (moving if s in moved else normal).append(t)
            for started, end, _ in r["rebalances"]:
                spans.append(end - started + 1)
                per_rb.append(sum(sec for s, _, sec in r["moves"] if started <= s <= end))
            layers += [n for _, n, _ in r["moves"]]
        out[mode] = {"steps": len(normal) + len(moving), "rebalances": len(per_rb),
                     "normal_ms": med(normal) * 1e3 if normal else float("nan"),
                     "moving_median_ms": med(moving) * 1e3 if moving else float("nan"),
                     "moving_max_ms": max(moving) * 1e3 if moving else float("nan"),
                     "weights_ms_per_rebalance": med(per_rb) * 1e3 if per_rb else float("nan"),
                     "max_layers_per_step": max(layers) if layers else 0,
                     "steps_per_rebalance": med(spans) if spans else 0}
        o = out[mode]
        o["max_over_normal"] = o["moving_max_ms"] / o["normal_ms"]
    return out


def run(cfg) -> int:
    from omegaconf import OmegaConf
    from rich.table import Table

    from inferhal.core.console import Progress, console as make_console
    from inferhal.core.engine.llm import LLM
    from inferhal.core.errors import UserError
    from inferhal.core.parallel.launch import spawn_from_file
    from inferhal.core.sampling.params import SamplingParams

    con = make_console()
    b = cfg.bench
    if str(cfg.model.family) != "deepseek_v4":
        raise UserError(f"bench eplb_live: model {cfg.model.name!r} has no routed experts (use model=deepseek_v4_tiny)")
    for key, value in WIDE.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    base = OmegaConf.to_container(cfg, resolve=True)
    base["deterministic"] = True  # batch-invariant ops: "same outputs" is bitwise, whatever replica a row used
    base["parallel"].update(tp=1, ep=2, dp=2)
    base["eplb"].update(enabled=True, step_interval=REBALANCE_EVERY, window_size=REBALANCE_EVERY)
    single_cfg = dict(base, parallel=dict(base["parallel"], ep=1, dp=1), eplb=dict(base["eplb"], enabled=False))
    single = LLM.from_config(OmegaConf.create(single_cfg))
    prompts = prompts_of(max(4, int(b.num_prompts)), int(single.engine.model.vocab_size))
    sp = SamplingParams(max_tokens=int(b.max_tokens), temperature=0.0, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in single.generate(prompts, sp)]
    del single
    repeats, warmup = max(1, int(b.repeats)), max(0, int(b.warmup))
    con.print(f"[bold]bench eplb_live[/bold]: model {cfg.model.name} widened ({', '.join(f'{k}={v}' for k, v in WIDE.items())}), "
              f"dep2 (gloo), {len(prompts)} prompts x {b.max_tokens} greedy tokens, a rebalance every "
              f"{REBALANCE_EVERY} steps; {warmup} untimed + {repeats} timed runs per mode, alternating; load average "
              f"{os.getloadavg()[0]:.1f}. Ratios within this run are the result.")
    here = os.path.abspath(__file__)
    with Progress("bench eplb_live", 1, every=0.0) as prog, tempfile.TemporaryDirectory() as tmp:
        spawn_from_file(here, "rank_body", 2, base, prompts, int(b.max_tokens), repeats, warmup, tmp)
        ranks = []
        for r in range(2):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
        prog.advance("dep2")
    res = summarize(ranks, want)
    t = Table(title="EPLB weight moves: step time (ms, medians over both ranks' timed steps)")
    for col in ("mode", "steps", "rebalances", "step without moves", "median step moving weights",
                "longest step moving weights", "longest / normal", "weights per rebalance", "layers per step (max)",
                "steps per rebalance"):
        t.add_column(col, justify="right" if col != "mode" else "left")
    for mode in MODES:
        o = res[mode]
        t.add_row(mode, str(o["steps"]), str(o["rebalances"]), f"{o['normal_ms']:.1f}", f"{o['moving_median_ms']:.1f}",
                  f"{o['moving_max_ms']:.1f}", f"{o['max_over_normal']:.2f}x", f"{o['weights_ms_per_rebalance']:.1f}",
                  str(o["max_layers_per_step"]), f"{o['steps_per_rebalance']:g}")
    con.print(t)
    con.print(f"outputs equal to a run without EPLB, both modes: {'yes' if res['equal'] else 'NO'}")
    result = {"model": str(cfg.model.name), "widened": WIDE, "rebalance_every": REBALANCE_EVERY,
              "prompts": len(prompts), "max_tokens": int(b.max_tokens), "repeats": repeats, "warmup": warmup,
              "load_average": os.getloadavg()[0], **res}
    path = write_json(cfg, "eplb_live.json", result)
    con.print(f"wrote {path}")
    return 0 if res["equal"] else 1
