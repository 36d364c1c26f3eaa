"""``inferhal bench ep model=deepseek_v4_tiny``: DP attention x EP MoE at dep1 (one process), dep2 and dep4,
counted per rank (work and bytes), in one run.

``bench.num_prompts`` random prompts (8 to 40 tokens, so the ranks' batches differ) of ``bench.max_tokens``
greedy tokens each run as one process and then as 2 and 4 spawned ranks (gloo on loopback;
:mod:`inferhal.core.parallel.dp_engine`). Per layout and rank: the attention tokens it ran (its own
requests' tokens only, so the ranks' sum is the single process's count), its all-to-all bytes sent
(``moe.dispatch`` + ``moe.combine``) against the planner's formula (:func:`inferhal.core.plan.roofline.
all_to_all_s`: rows x top-k x (ep-1)/ep x hidden x bytes each way, uniform routing; here with the model's
dtype both ways and the 8-byte expert id our dispatch sends) fed this run's own MoE rows, and the median wall time of a step. Outputs must equal the single process's; the exit status says so.

On a 2-core host, wall-clock scaling proves little (2 or 4 ranks share 2 cores): the work and the bytes
are the result; step times are printed so that nobody mistakes them for a scaling claim.

**Two-batch overlap** (``parallel.tbo``, :mod:`inferhal.core.parallel.tbo`): dep2 once more, in one spawned
group that generates the same prompts ``bench.repeats`` times without and with overlap, alternating (after
``bench.warmup`` untimed runs). Per step: the wall time, the all-to-all time (``moe.dispatch`` +
``moe.combine`` collectives, on whichever thread; on gloo this includes waiting for the peer), the part the
forward's thread waited out (exposed), the part that passed while it computed (hidden = all-to-all −
exposed) and the rest of the step (compute, headers, host work: step − exposed); medians over all timed
steps, and the with/without ratios of the median step and of the median run. Outputs must be the same.
On a 2-core host the two ranks and their communication threads share two cores: what the overlap hides
there says little about a machine with a core per rank and a real network.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

from inferhal.core.bench import write_json

LAYOUTS = (1, 2, 4)
TBO = True  # also measure two-batch overlap on dep2


def time_steps(engine) -> list[float]:
    """Wrap ``engine.step`` so that each call's wall seconds are appended to the returned list."""
    times: list[float] = []
    real = engine.step

    def timed():
        t0 = time.perf_counter()
        out = real()
        times.append(time.perf_counter() - t0)
        return out

    engine.step = timed
    return times


def prompts_of(n: int, vocab: int) -> list[list[int]]:
    return [[(13 * i + 7 * j) % (vocab - 3) + 3 for j in range(8 + (11 * i) % 33)] for i in range(n)]


def rank_body(layout, cfg_dict: dict, prompts: list, max_tokens: int, out_dir: str) -> None:
    """One DP/EP rank: generate, then write its per-step log (attention tokens, MoE rows, bytes, seconds)."""
    import torch
    from omegaconf import OmegaConf

    from inferhal.core.parallel.ep_generate import dp_llm
    from inferhal.core.sampling.params import SamplingParams

    torch.set_num_threads(1)
    llm, hook = dp_llm(OmegaConf.create(cfg_dict), layout)
    eng = llm.engine
    times = time_steps(eng)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    rows = [{"attn_tokens": s.attn_tokens, "moe_rows": s.moe.token_rows, "a2a_bytes": s.moe.a2a_bytes,
             "rounds": s.moe.rounds, "empty_rounds": s.moe.empty_rounds} for s in hook.log]
    with open(os.path.join(out_dir, f"rank{layout.rank}.json"), "w") as f:
        json.dump({"steps": rows, "step_s": times, "tokens": [list(o.outputs[0].token_ids) for o in outs]}, f)
    import torch.distributed as dist

    dist.barrier()  # nobody tears the group down while a peer is still in its last exchange


def tbo_rank_body(layout, cfg_dict: dict, prompts: list, max_tokens: int, repeats: int, warmup: int,
                  out_dir: str) -> None:
    """One dep rank: the prompts ``warmup`` times untimed, then ``repeats`` times without and with two-batch
    overlap, alternating; writes per run and step the wall time, all-to-all and exposed seconds."""
    import torch
    from omegaconf import OmegaConf

    from inferhal.core.parallel.ep_generate import dp_llm
    from inferhal.core.sampling.params import SamplingParams

    torch.set_num_threads(1)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    runs = []
    for i in range(warmup + 2 * repeats):
        tbo = i >= warmup and (i - warmup) % 2 == 1
        llm, hook = dp_llm(OmegaConf.create(dict(cfg_dict, parallel=dict(cfg_dict["parallel"], tbo=tbo))), layout)
        eng = llm.engine
        times = time_steps(eng)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        wall = time.perf_counter() - t0
        if i >= warmup:
            runs.append({"tbo": tbo, "wall_s": wall, "step_s": times, "a2a_s": [s.moe.a2a_s for s in hook.log],
                         "wait_s": [s.moe.wait_s for s in hook.log], "split": [s.moe.split_passes for s in hook.log],
                         "tokens": [list(o.outputs[0].token_ids) for o in outs]})
    with open(os.path.join(out_dir, f"rank{layout.rank}.json"), "w") as f:
        json.dump(runs, f)
    import torch.distributed as dist

    dist.barrier()


def tbo_summary(ranks: list[list[dict]], want: list) -> dict:
    """Medians per mode over every rank's timed steps (ms), and the with/without ratios."""
    med = statistics.median
    out: dict = {"equal": all(r["tokens"] == want for runs in ranks for r in runs)}
    for tbo, key in ((False, "off"), (True, "on")):
        runs = [r for rk in ranks for r in rk if r["tbo"] == tbo]
        steps = [(st, a, w) for r in runs for st, a, w in zip(r["step_s"], r["a2a_s"], r["wait_s"])]
        out[key] = {"steps": len(steps), "split_steps": sum(1 for r in runs for n in r["split"] if n),
                    "step_ms": med(st for st, _, _ in steps) * 1e3, "a2a_ms": med(a for _, a, _ in steps) * 1e3,
                    "exposed_ms": med(w for _, _, w in steps) * 1e3,
                    "hidden_ms": med(a - w for _, a, w in steps) * 1e3,
                    "rest_ms": med(st - w for st, _, w in steps) * 1e3,
                    "hidden_total_ms": sum(a - w for _, a, w in steps) * 1e3,
                    "a2a_total_ms": sum(a for _, a, _ in steps) * 1e3,
                    "run_s": med(r["wall_s"] for r in runs)}
    out["step_ratio"] = out["on"]["step_ms"] / out["off"]["step_ms"]
    out["run_ratio"] = out["on"]["run_s"] / out["off"]["run_s"]
    return out


def run(cfg) -> int:
    import torch
    from omegaconf import OmegaConf
    from rich.table import Table

    from inferhal.core.console import Progress, console as make_console
    from inferhal.core.engine.llm import LLM
    from inferhal.core.parallel.launch import spawn_from_file
    from inferhal.core.sampling.params import SamplingParams

    con = make_console()
    b = cfg.bench
    base = OmegaConf.to_container(cfg, resolve=True)
    base["parallel"].update(tp=1, ep=1, dp=1)
    single = LLM.from_config(OmegaConf.create(base))
    model = single.engine.model
    if not hasattr(model, "routed_expert_weights"):
        from inferhal.core.errors import UserError

        raise UserError(f"bench ep: model {cfg.model.name!r} has no routed experts (use model=deepseek_v4_tiny)")
    prompts = prompts_of(max(4, int(b.num_prompts)), int(model.vocab_size))
    hidden, top_k = int(model.cfg.hidden_size), int(model.cfg.top_k)
    elt = torch.empty((), dtype=model.dtype).element_size()
    con.print(f"[bold]bench ep[/bold]: model {cfg.model.name}, {len(prompts)} prompts x {b.max_tokens} greedy "
              f"tokens; dep1 in this process, dep2/dep4 as spawned ranks (gloo); load average "
              f"{os.getloadavg()[0]:.1f}. Counted work and bytes are the result; step times on a shared 2-core "
              f"host are not a scaling claim.")
    results = {}
    with Progress("bench ep", len(LAYOUTS) + int(TBO), every=0.0) as prog:
        steps = 0
        t_eng = single.engine
        times = time_steps(t_eng)
        attn = 0
        outs = []
        sp = SamplingParams(max_tokens=int(b.max_tokens), temperature=0.0, ignore_eos=True)
        ids = [t_eng.add_request(p, sp) for p in prompts]
        done = {}
        while t_eng.has_unfinished():
            for o in t_eng.step():
                if o.finished:
                    done[o.request_id] = list(o.outputs[0].token_ids)
            attn += t_eng.last_step["num_tokens"]
            steps += 1
        outs = [done[i] for i in ids]
        results[1] = {"ranks": [{"attn_tokens": attn, "a2a_bytes": 0, "moe_rows": 0, "steps": steps,
                                 "step_ms": statistics.median(times) * 1e3}], "equal": True}
        prog.advance("dep1")
        here = os.path.join(os.path.dirname(__file__), "ep.py")
        for n in LAYOUTS[1:]:
            d = dict(base)
            d["parallel"] = dict(base["parallel"], ep=n, dp=n)
            with tempfile.TemporaryDirectory() as tmp:
                spawn_from_file(here, "rank_body", n, d, prompts, int(b.max_tokens), tmp)
                ranks = []
                equal = True
                for r in range(n):
                    with open(os.path.join(tmp, f"rank{r}.json")) as f:
                        got = json.load(f)
                    equal &= got["tokens"] == outs
                    st = got["steps"]
                    rows = sum(s["moe_rows"] for s in st)
                    ranks.append({"attn_tokens": sum(s["attn_tokens"] for s in st), "moe_rows": rows,
                                  "a2a_bytes": sum(s["a2a_bytes"] for s in st), "steps": len(st),
                                  "planned_a2a_bytes": rows * top_k * (n - 1) / n * (hidden * elt * 2 + 8),
                                  "empty_rounds": sum(s["empty_rounds"] for s in st),
                                  "step_ms": statistics.median(got["step_s"]) * 1e3})
            results[n] = {"ranks": ranks, "equal": equal}
            prog.advance(f"dep{n}")
        tbo = None
        if TBO:
            d = dict(base)
            d["parallel"] = dict(base["parallel"], ep=2, dp=2)
            with tempfile.TemporaryDirectory() as tmp:
                spawn_from_file(here, "tbo_rank_body", 2, d, prompts, int(b.max_tokens), max(1, int(b.repeats)),
                                int(b.warmup), tmp)
                got = []
                for r in range(2):
                    with open(os.path.join(tmp, f"rank{r}.json")) as f:
                        got.append(json.load(f))
            tbo = tbo_summary(got, outs)
            prog.advance("dep2 tbo")
    t = Table(title="DP attention x EP MoE, per rank (counted; step ms on a shared host is not scaling)")
    for col in ("layout", "rank", "attention tokens", "share", "MoE rows", "a2a bytes sent", "planner bytes",
                "sent / planned", "empty rounds", "steps", "step ms (median)", "same tokens"):
        t.add_column(col, justify="right")
    total = results[1]["ranks"][0]["attn_tokens"]
    for n, res in results.items():
        for r, row in enumerate(res["ranks"]):
            plan = row.get("planned_a2a_bytes", 0.0)
            t.add_row(f"dep{n}", str(r), str(row["attn_tokens"]), f"{row['attn_tokens'] / total:.0%}",
                      str(row["moe_rows"]), f"{row['a2a_bytes']:,}", f"{plan:,.0f}" if n > 1 else "-",
                      f"{row['a2a_bytes'] / plan:.2f}" if plan else "-", str(row.get("empty_rounds", 0)),
                      str(row["steps"]), f"{row['step_ms']:.1f}", "yes" if res["equal"] else "NO")
    con.print(t)
    for n, res in results.items():
        if n > 1:
            sent, plan = (sum(r[k] for r in res["ranks"]) for k in ("a2a_bytes", "planned_a2a_bytes"))
            res["sent_over_planned"] = sent / plan
            con.print(f"dep{n}: all ranks sent {sent:,} B against the planner's {plan:,.0f} B ({sent / plan:.2f}x); "
                      f"attention tokens {sum(r['attn_tokens'] for r in res['ranks'])} = the single process's {total}")
    con.print(f"(planner bytes: this run's MoE rows x top-{top_k} x (ep-1)/ep x (hidden {hidden} x {elt} B each way, "
              f"dispatch and combine in the model's dtype, + an 8-byte expert id dispatched), uniform routing)")
    if tbo is not None:
        t = Table(title="dep2 two-batch overlap (parallel.tbo), medians per step over both ranks' timed runs, ms; "
                        "2 ranks + their communication threads on this host's cores: not a hardware claim")
        for col in ("tbo", "steps", "split steps", "step", "all-to-all", "exposed", "hidden", "step - exposed",
                    "a2a / (step - exposed)", "run s (median)", "same tokens"):
            t.add_column(col, justify="right")
        for key in ("off", "on"):
            m = tbo[key]
            t.add_row(key, str(m["steps"]), str(m["split_steps"]), f"{m['step_ms']:.2f}", f"{m['a2a_ms']:.2f}",
                      f"{m['exposed_ms']:.2f}", f"{m['hidden_ms']:.2f}", f"{m['rest_ms']:.2f}",
                      f"{m['a2a_ms'] / m['rest_ms']:.2f}" if m["rest_ms"] else "-", f"{m['run_s']:.3f}",
                      "yes" if tbo["equal"] else "NO")
        con.print(t)
        on = tbo["on"]
        con.print(f"with/without overlap: median step {tbo['step_ratio']:.2f}x, median run {tbo['run_ratio']:.2f}x; "
                  f"hidden {on['hidden_total_ms']:.1f} of {on['a2a_total_ms']:.1f} ms of all-to-all "
                  f"({on['hidden_total_ms'] / max(on['a2a_total_ms'], 1e-9):.0%})")
    result = {"model": str(cfg.model.name), "exec": "spawned ranks on this host (gloo)",
              "load_average": os.getloadavg()[0], "layouts": {f"dep{n}": r for n, r in results.items()},
              "tbo": tbo}
    out = write_json(cfg, "ep.json", result)
    con.print(f"wrote {out}")
    return 0 if all(r["equal"] for r in results.values()) and (tbo is None or tbo["equal"]) else 1
