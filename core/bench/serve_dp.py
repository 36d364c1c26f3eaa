"""``inferhal bench serve parallel=dep2``: a skewed workload against ``inferhal serve`` over DP ranks, placed by
``tokens_cache``, by vLLM's ``waiting * 4 + running`` and round robin, and against one colocated engine.

The workload (seeded, :func:`sessions`): ``bench.num_prompts`` multi-turn sessions of up to three turns, each
turn's prompt the previous prompt plus its answer plus a follow-up (so a session's next turn can find its
history in the prefix cache of the rank that served it). One session in four is long (a shared ~120-token
system prompt of one of three groups, then a ~220-token document); the others are short questions, half of
them behind a group's system prompt (prefixes shared across sessions). Answers are ``bench.max_tokens``
greedy tokens; a session ends early rather than pass ``model.max_model_len``. For each ``bench.concurrency``
level ``c``, ``c`` clients each run one session after another, turn after turn, streaming
(:mod:`.serve_client`).

Each variant is a fresh ``inferhal serve`` child (as ``bench serve`` starts it; the colocated engine with
``parallel=single`` and the same scheduler and cache per engine). Reported per variant and level: requests,
output tok/s, TTFT and TPOT p50/p99 (client side; TPOT = (last token - first) / (tokens - 1) per request), the
prefix-cache hit rate (``inferhal_prefix_cache_hits_total`` / ``_queries_total`` over the run), and for the DP
variants each rank's attention tokens and prompt tokens over the run with their balance (max / mean; 1.0 is
even). Checked: every request of every variant completed, and its text equals the colocated engine's (greedy,
the same sessions); the exit status is 1 otherwise. ``output=`` (default ``<bench.output_dir>/serve_dp.json``).
Clients, front and ranks share the host's CPUs: on a 2-core machine the latencies say more about placement
(prefill recomputed, queues) than about speed.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import string
import time
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from inferhal.core import procs
from inferhal.core.bench.scrape import get
from inferhal.core.bench.stamp import stamp
from inferhal.core.parallel.launch import free_port

#: (name, parallel overrides) of the variants, the colocated engine last (the others' texts are checked against it)
VARIANTS = (("dep tokens_cache", {"dp_balance": "tokens_cache"}), ("dep vllm", {"dp_balance": "vllm"}),
            ("dep round_robin", {"dp_balance": "round_robin"}), ("colocated", None))
GROUPS, TURNS = 3, 3


def _words(rng: random.Random, n: int) -> str:
    letters = string.ascii_lowercase
    out = []
    while sum(len(w) + 1 for w in out) < n:
        out.append("".join(rng.choice(letters) for _ in range(rng.randint(2, 8))))
    return " ".join(out)[:n]


def sessions(n: int, seed: int = 0) -> list[list[str]]:
    """Per session, its first prompt then its follow-ups (module docstring)."""
    rng = random.Random(seed)
    systems = [f"System {g}: " + _words(rng, 110) + "\n" for g in range(GROUPS)]
    out = []
    for s in range(n):
        group = systems[s % GROUPS]
        if s % 4 == 0:
            first = group + "Document: " + _words(rng, 210) + "\nQ: " + _words(rng, 20) + "\nA:"
        elif s % 2:
            first = "Q: " + _words(rng, 25) + "\nA:"
        else:
            first = group + "Q: " + _words(rng, 25) + "\nA:"
        out.append([first] + ["\nQ: " + _words(rng, 20) + "\nA:" for _ in range(TURNS - 1)])
    return out


async def _load(port: int, model: str, plan: list[list[str]], max_tokens: int, max_len: int, c: int):
    """Run every session (``c`` at a time) → (seconds, {(session, turn): StreamResult})."""
    from inferhal.core.bench.serve_client import stream_completion

    todo, results = list(range(len(plan))), {}

    async def client():
        while todo:
            s = todo.pop(0)
            prompt = ""
            for t, part in enumerate(plan[s]):
                prompt += part
                if len(prompt) + max_tokens >= max_len:  # (one token a character, at most)
                    break
                body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                r = results[(s, t)] = await stream_completion("127.0.0.1", port, body)
                if r.status != 200 or not r.done:
                    break
                prompt += r.text

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(c)))
    return time.perf_counter() - t0, results


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def _serve(cfg, port: int) -> None:
    """The child process: ``inferhal serve`` with ``cfg`` on 127.0.0.1:``port``."""
    import sys

    from inferhal.core.server.serve import serve

    OmegaConf.update(cfg, "server.host", "127.0.0.1", merge=False)
    OmegaConf.update(cfg, "server.port", port, merge=False)
    sys.exit(serve(cfg))


def _total(text: str, name: str) -> float:
    """A metric summed over its label sets."""
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def _per_rank(text: str, name: str) -> dict[int, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(rf'{name}\{{.*dp_rank="(\d+)".*\}} (\S+)$', line)
        if m:
            out[int(m.group(1))] = float(m.group(2))
    return out


def _variant_cfg(cfg, over):
    from inferhal.core.config.refusals import default_of

    c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    if over is None:  # one engine: every parallel field at its default
        for f in ("ep", "dp", "launcher", "master_addr", "master_port", "tbo", "dp_balance", "dp_balance_margin",
                  "restarts"):
            OmegaConf.update(c, f"parallel.{f}", default_of(f"parallel.{f}"), merge=False)
    else:
        for k, v in over.items():
            OmegaConf.update(c, f"parallel.{k}", v, merge=False)
    return c


def _run_variant(cfg, model: str, plan, max_tokens: int, levels: list[int], warmup: bool, log) -> dict:
    port = free_port()
    proc = procs.context().Process(target=_serve, args=(cfg, port), daemon=False)
    proc.start()
    base, max_len = f"http://127.0.0.1:{port}", int(cfg.model.max_model_len)
    deadline = time.monotonic() + 300
    while get(base + "/health")[0] != 200:
        if not proc.is_alive() or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the server did not start")
        time.sleep(0.2)
    rows = []
    try:
        if warmup:
            asyncio.run(_load(port, model, [["Warm up " + "x" * 40]] * 2, 4, max_len, 2))
        for c in levels:
            _, before = get(base + "/metrics")
            wall, res = asyncio.run(_load(port, model, plan, max_tokens, max_len, c))
            _, after = get(base + "/metrics")
            d = {k: _total(after, f"inferhal_{k}_total") - _total(before, f"inferhal_{k}_total")
                 for k in ("prefix_cache_hits", "prefix_cache_queries", "generation_tokens", "num_preemptions")}
            ok = [r for r in res.values() if r.status == 200 and r.done and not r.error]
            ttft = [r.first - r.start for r in ok if r.first]
            tpot = [(r.times[-1] - r.first) / (r.completion_tokens - 1) for r in ok if r.first and r.completion_tokens > 1]
            row = {"concurrency": c, "requests": len(res), "completed": len(ok), "tok_s": d["generation_tokens"] / wall,
                   "preemptions": int(d["num_preemptions"]),
                   "prefix_hit_rate": d["prefix_cache_hits"] / d["prefix_cache_queries"] if d["prefix_cache_queries"]
                   else 0.0, "ttft_s": {q: pct(ttft, q) for q in (50, 99)}, "tpot_s": {q: pct(tpot, q) for q in (50, 99)},
                   "texts": {f"{s}/{t}": r.text for (s, t), r in sorted(res.items())}}
            for key, name in (("attention_tokens", "inferhal_dp_attention_tokens_total"),
                              ("prompt_tokens", "inferhal_dp_prompt_tokens_total")):
                a, b = _per_rank(after, name), _per_rank(before, name)
                if a:
                    per = [a[r] - b.get(r, 0.0) for r in sorted(a)]
                    row[f"rank_{key}"] = per
                    row[f"{key}_balance"] = max(per) / (sum(per) / len(per)) if sum(per) else 0.0
            rows.append(row)
            log(row)
    finally:
        proc.terminate()
        proc.join(60)
    return {"rows": rows, "server_exit": proc.exitcode}


def run_dp(cfg) -> int:
    """The DP serving benchmark (module docstring): ``inferhal bench serve`` with ``parallel.dp > 1``."""
    from rich.table import Table

    from inferhal.core.console import console as make_console

    con = make_console(min_width=160)
    b = cfg.bench
    levels, n, max_tokens = [int(c) for c in b.concurrency], int(b.num_prompts), int(b.max_tokens)
    model = str(cfg.server.served_model_name or cfg.model.name)
    plan = sessions(n)
    dp = int(cfg.parallel.dp)
    con.print(f"[bench serve] {model}: {n} sessions (up to {TURNS} turns, skewed) x {max_tokens} greedy tokens at "
              f"concurrency {levels}; dep{dp} by tokens_cache, vllm, round_robin, and one colocated engine",
              highlight=False)
    out, failures = {}, []
    for name, over in VARIANTS:
        con.print(f"  {name} ...", highlight=False)

        def log(row, name=name):
            bal = f", attention tokens per rank {[int(v) for v in row['rank_attention_tokens']]} (balance " \
                  f"{row['attention_tokens_balance']:.2f})" if "rank_attention_tokens" in row else ""
            con.print(f"    c={row['concurrency']}: {row['completed']}/{row['requests']} requests, {row['tok_s']:.1f} "
                      f"tok/s, prefix hits {100 * row['prefix_hit_rate']:.0f}%, {row['preemptions']} preemptions{bal}",
                      highlight=False)

        out[name] = _run_variant(_variant_cfg(cfg, over), model, plan, max_tokens, levels, bool(int(b.warmup)), log)
    ref = {r["concurrency"]: r["texts"] for r in out["colocated"]["rows"]}
    for name, v in out.items():
        if v["server_exit"] != 0:
            failures.append(f"{name}: the server exited {v['server_exit']} after SIGTERM")
        for r in v["rows"]:
            if r["completed"] != r["requests"]:
                failures.append(f"{name} c={r['concurrency']}: {r['requests'] - r['completed']} requests failed")
            bad = [k for k, t in r["texts"].items() if ref[r["concurrency"]].get(k) != t]
            if bad:
                failures.append(f"{name} c={r['concurrency']}: {len(bad)} texts differ from the colocated engine's "
                                f"(first: session/turn {bad[0]})")
    table = Table(title=f"inferhal serve over dep{dp} against one engine: {model}, {n} sessions x {max_tokens} tokens, "
                        f"backend {cfg.backend.name} (a shared host: placement, not speed)")
    for col in ("variant", "c", "requests", "tok/s", "prefix hits", "TTFT p50/p99 ms", "TPOT p50/p99 ms",
                "attention tokens per rank", "balance"):
        table.add_column(col, justify="right")
    for name, v in out.items():
        for r in v["rows"]:
            table.add_row(name, str(r["concurrency"]), str(r["requests"]), f"{r['tok_s']:.1f}",
                          f"{100 * r['prefix_hit_rate']:.1f}%", "/".join(f"{1000 * r['ttft_s'][q]:.0f}" for q in (50, 99)),
                          "/".join(f"{1000 * r['tpot_s'][q]:.0f}" for q in (50, 99)),
                          " / ".join(str(int(x)) for x in r.get("rank_attention_tokens", [])) or "-",
                          f"{r['attention_tokens_balance']:.2f}" if "attention_tokens_balance" in r else "-")
    con.print(table)
    for f in failures:
        con.print(f"FAIL {f}", highlight=False)
    path = Path(str(cfg.get("output") or Path(str(b.output_dir)) / "serve_dp.json"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": model, "backend": str(cfg.backend.name), "dp": dp, "sessions": n,
                                "turns": TURNS, "max_tokens": max_tokens, "variants": out, "failures": failures,
                                "note": "clients, server front and ranks on one shared host", "stamp": stamp()},
                               indent=1))
    con.print(f"wrote {path}", highlight=False)
    return 1 if failures else 0
