"""``inferhal bench spec``: MTP speculative decoding against no drafts, in one run.

On ``deepseek_v4_tiny_mtp`` (the tiny random V4 with its MTP layer fitted to the model's own greedy
continuations, ``fit_mtp``), at k = 1, 2, 3 drafts and at concurrency c = 1 and 8:
``min(bench.num_prompts, 2c + 2)`` random 8-token prompts, ``bench.max_tokens`` greedy tokens each; per k
the acceptance rate at each draft position, the mean tokens a verify step yields (accepted + 1)
and wall-clock output tok/s, each with ``scheduler.async_scheduling`` off and on (async: the drafter runs
on the step thread), (best and median of ``bench.repeats`` runs after ``bench.warmup``, every k in
turn so that load drifts on a shared host hit them alike; the best is the least disturbed), beside k = 0 in sync mode.
The greedy outputs are checked to equal those without drafts. ``output=`` (default
``<bench.output_dir>/spec.json``) gets the JSON.

On the CPU reference a verify step of k + 1 tokens costs about k + 1 times a decode step at c=1 for
this tiny model (its products are too small to be bound by reading weights), so tok/s gains need
acceptance well above what it costs; on an accelerator the decode step is memory bound and verifying
k + 1 tokens costs about as much as one.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from inferhal.core.bench import write_json
from inferhal.core.config.schema import CacheConfig, SchedulerConfig, SpecConfig
from inferhal.core.engine.engine import Engine
from inferhal.core.sampling.params import SamplingParams

MODEL = "deepseek_v4_tiny_mtp"
KS = (0, 1, 2, 3)
CONCURRENCY = (1, 8)


def _load(cfg):
    from omegaconf import OmegaConf

    from inferhal.core.config import schema
    from inferhal.core.engine.llm import _to, compose_config
    from inferhal.core.models.registry import load_model
    from inferhal.core.registry import BackendRegistry

    backend = BackendRegistry.discover().select(schema.BackendConfig(**OmegaConf.to_container(cfg.backend, resolve=True)))
    return load_model(_to(schema.ModelConfig, compose_config(model=MODEL).model), backend), backend


def one(loaded, backend, k: int, concurrency: int, prompts, max_tokens: int, asynchronous: bool = False) -> dict:
    spec = SpecConfig(method="mtp", num_speculative_tokens=k) if k else SpecConfig()
    eng = Engine(loaded, backend, SchedulerConfig(max_num_seqs=concurrency, max_num_batched_tokens=2048,
                                                  async_scheduling=asynchronous),
                 CacheConfig(enable_prefix_caching=False, num_blocks=concurrency * 8 + 16), spec=spec)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request(p, sp) for p in prompts]
    t0 = time.perf_counter()
    n, done = 0, {}
    while eng.has_unfinished():
        for o in eng.step():
            n += len(o.new_token_ids)
            if o.finished:
                done[o.request_id] = o.token_ids
    dt = time.perf_counter() - t0
    st = eng.stats
    drafted, accepted = st["drafted_at"], st["accepted_at"]
    steps = drafted[0] if drafted else 0
    return {"k": k, "mode": "async" if asynchronous else "sync", "concurrency": concurrency, "tok_s": n / dt, "outputs": [done[i] for i in ids],
            "acceptance_per_position": [a / d if d else 0.0 for a, d in zip(accepted, drafted)],
            "tokens_per_verify_step": (st["accepted_tokens"] + steps) / steps if steps else 1.0,
            "draft_tokens": st["draft_tokens"], "accepted_tokens": st["accepted_tokens"]}


def run(cfg) -> int:
    from rich.table import Table

    from inferhal.core.console import Progress, console as make_console

    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
    loaded, backend = _load(cfg)
    b = cfg.bench
    con = make_console()
    con.print(f"[bold]bench spec[/bold]: model {MODEL} (fitted MTP layer), backend {backend.name}, torch threads "
              f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f} (shared machines: compare ratios "
              f"within one run)")
    g = torch.Generator().manual_seed(1234)  # prompts unlike the fit's (seed 0)
    vocab = loaded.model.vocab_size
    rows = []
    cases = [(k, a) for k in KS for a in (False, True)]
    with Progress("bench spec", len(cases) * len(CONCURRENCY), every=0.0) as prog:
        for c in CONCURRENCY:
            count = min(int(b.num_prompts), 2 * c + 2)
            prompts = [torch.randint(3, vocab, (8,), generator=g).tolist() for _ in range(count)]
            base = None
            runs: dict[tuple, list] = {case: [] for case in cases}
            for rep in range(int(b.warmup) + int(b.repeats)):  # round-robin: load drifts hit every case alike
                for k, a in cases:
                    r = one(loaded, backend, k, c, prompts, int(b.max_tokens), a)
                    if rep >= int(b.warmup):
                        runs[k, a].append(r)
            for case in cases:
                prog.advance(f"k={case[0]} {'async' if case[1] else 'sync'} at concurrency {c}", n=0)
                r = dict(runs[case][-1], tok_s=statistics.median(x["tok_s"] for x in runs[case]),
                         best_tok_s=max(x["tok_s"] for x in runs[case]), runs=[x["tok_s"] for x in runs[case]])
                outputs = r.pop("outputs")
                base = base or (outputs, r["best_tok_s"])
                r["identical_to_no_drafts"] = outputs == base[0]
                r["speedup"] = r["best_tok_s"] / base[1]
                rows.append(r)
                prog.advance()
    t = Table(title=f"MTP drafts, 2c + 2 prompts x {b.max_tokens} greedy tokens (median of {b.repeats})")
    for col in ("c", "k", "scheduling", "acceptance by position", "tokens / verify step", "best tok/s", "median tok/s",
                "best vs k=0", "same output"):
        t.add_column(col, justify="right")
    for r in rows:
        acc = " ".join(f"{a:.0%}" for a in r["acceptance_per_position"]) or "-"
        t.add_row(str(r["concurrency"]), str(r["k"]), r["mode"], acc, f"{r['tokens_per_verify_step']:.2f}", f"{r['best_tok_s']:.1f}", f"{r['tok_s']:.1f}",
                  f"{r['speedup']:.2f}x", "yes" if r["identical_to_no_drafts"] else "NO")
    con.print(t)
    result = {"model": MODEL, "backend": backend.name, "exec": "reference backend on the host CPU",
              "load_average": os.getloadavg()[0], "rows": rows}
    out = write_json(cfg, "spec.json", result)
    con.print(f"wrote {out}")
    return 0 if all(r["identical_to_no_drafts"] for r in rows) else 1
