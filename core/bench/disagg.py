"""``inferhal bench disagg model=deepseek_v4_tiny``: prefill/decode disaggregation against one colocated
engine, in one run, on a mixed workload.

``bench.num_prompts`` requests, submitted together: every other one a long prompt (half of
``model.max_model_len``, at most 1,024 tokens) with a short output (``bench.max_tokens // 4``), the rest a
16-token prompt with a long output (``bench.max_tokens``); greedy, EOS ignored. The colocated engine runs
them as one engine; the disaggregated pair (:mod:`inferhal.core.disagg.local`: a prefill engine and a
decode engine over the same loaded model, the loopback connector) runs them again. Reported, per side:
TTFT and TPOT at p50/p99 (TTFT: submission to the first token, which the prefill engine samples; TPOT:
(last - first token) / (tokens - 1)), wall time, and for the pair, per request, the KV bytes moved against
what ``inferhal plan kv`` says the request stores (the blocks are whole pages, the plan counts tokens),
and the transfer time (on loopback: a copy). Outputs must be equal; the exit status says so.

On a CPU host both engines of the pair share the same cores (they step in turn in one process), so the
pair cannot be faster: the numbers are correctness and accounting (bytes, the transfer's share of the
time), not a speed claim. On separate devices prefill and decode overlap, which is what disaggregation
buys (see docs/disaggregation.md).
"""

from __future__ import annotations

import os
import statistics
import time

from inferhal.core.bench import write_json
from inferhal.core.console import Progress, console as make_console


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def _latency(first: dict, finish: dict, ntok: dict) -> dict:
    ttft = list(first.values())
    tpot = [(finish[r] - first[r]) / (ntok[r] - 1) for r in finish if ntok[r] > 1]
    return {"ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
            "tpot_p50_s": _pct(tpot, 0.5), "tpot_p99_s": _pct(tpot, 0.99)}


def workload(vocab: int, max_model_len: int, n: int, max_tokens: int):
    from inferhal.core.sampling.params import SamplingParams

    long_len = max(32, min(1024, max_model_len // 2))
    prompts, params = [], []
    for i in range(n):
        long = i % 2 == 0
        length = long_len if long else 16
        prompts.append([(31 * i + 7 * j) % (vocab - 3) + 3 for j in range(length)])
        params.append(SamplingParams(max_tokens=max(2, max_tokens // 4) if long else max_tokens, temperature=0.0,
                                     ignore_eos=True))
    return prompts, params


def colocated(engine, prompts, params) -> tuple[list, dict]:
    t0 = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    first, finish, done = {}, {}, {}
    while engine.has_unfinished():
        for o in engine.step():
            now = time.perf_counter() - t0
            if o.outputs[0].token_ids:
                first.setdefault(o.request_id, now)
            if o.finished:
                finish[o.request_id], done[o.request_id] = now, o
    outs = [done[i] for i in ids]
    return outs, {"wall_s": time.perf_counter() - t0, **_latency(first, finish, {o.request_id: len(o.outputs[0].token_ids)
                                                                             for o in outs})}


def run(cfg) -> int:
    from rich.table import Table

    from inferhal.core.disagg import local
    from inferhal.core.disagg.handoff import side
    from inferhal.core.engine.engine import Engine
    from inferhal.core.engine.llm import LLM

    con = make_console()
    b = cfg.bench
    llm = LLM.from_config(cfg)
    e = llm.engine
    prompts, params = workload(int(e.model.vocab_size), e.max_model_len, int(b.num_prompts), int(b.max_tokens))
    con.print(f"[bold]bench disagg[/bold]: model {cfg.model.name}, backend {e.backend.name}, {len(prompts)} requests "
              f"({len(prompts[0])}-token prompts x {params[0].max_tokens} tokens, 16-token prompts x "
              f"{params[-1].max_tokens if len(params) > 1 else '-'} tokens); load average {os.getloadavg()[0]:.1f}")
    make = lambda role: Engine(e.loaded, e.backend, e.scheduler.cfg, cfg.cache, e.max_model_len,
                               transfer=None if role == "any" else side(role))
    rows = {}
    with Progress("bench disagg", 2 * int(b.repeats), every=0.0) as prog:
        runs = {"colocated": [], "disaggregated": []}
        for rep in range(int(b.repeats)):
            outs_c, lat_c = colocated(make("any"), prompts, params)
            prog.advance(f"colocated, repeat {rep + 1}")
            pre, dec = make("prefill"), make("decode")
            outs_d, stats = local.generate(pre, dec, prompts, params)
            n = {o.request_id: len(o.outputs[0].token_ids) for o in outs_d}
            lat_d = {"wall_s": max(stats.finish_s.values()), **_latency(stats.first_token_s, stats.finish_s, n)}
            prog.advance(f"disaggregated, repeat {rep + 1}")
            runs["colocated"].append((lat_c, outs_c))
            runs["disaggregated"].append((lat_d, outs_d, stats, pre))
    same = all([o.outputs[0].token_ids for o in c[1]] == [o.outputs[0].token_ids for o in d[1]]
               for c, d in zip(runs["colocated"], runs["disaggregated"]))
    for side, rs in runs.items():
        med = sorted(rs, key=lambda r: r[0]["wall_s"])[len(rs) // 2]
        rows[side] = med[0]
    lat_d, outs_d, stats, pre = sorted(runs["disaggregated"], key=lambda r: r[0]["wall_s"])[len(runs["disaggregated"]) // 2]
    per_req = []
    for p, o in zip(prompts, outs_d):
        rid = o.request_id
        if rid not in stats.bytes:
            continue
        planned = sum(s.bytes_per_token() * (min(s.window, len(p)) if s.kind == "sliding" else len(p)) for s in pre.specs)
        per_req.append({"request": rid, "prompt_tokens": len(p), "bytes": stats.bytes[rid], "plan_kv_bytes": planned,
                        "ratio": stats.bytes[rid] / planned, "transfer_s": stats.seconds[rid], "blocks": stats.blocks[rid]})
    t = Table(title="colocated vs disaggregated (one process, loopback connector; median of "
                    f"{b.repeats} by wall time)")
    for col in ("engine", "wall s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms"):
        t.add_column(col, justify="right")
    for side, r in rows.items():
        t.add_row(side, f"{r['wall_s']:.2f}", f"{r['ttft_p50_s'] * 1e3:.1f}", f"{r['ttft_p99_s'] * 1e3:.1f}",
                  f"{r['tpot_p50_s'] * 1e3:.1f}", f"{r['tpot_p99_s'] * 1e3:.1f}")
    con.print(t)
    t2 = Table(title="KV moved per request against plan kv (tokens x bytes/token; a sliding group: its window)")
    for col in ("prompt tokens", "requests", "bytes moved", "plan kv bytes", "moved / plan", "transfer ms (median)"):
        t2.add_column(col, justify="right")
    for length in sorted({r["prompt_tokens"] for r in per_req}):
        rs = [r for r in per_req if r["prompt_tokens"] == length]
        t2.add_row(str(length), str(len(rs)), f"{rs[0]['bytes']:,}", f"{rs[0]['plan_kv_bytes']:,.0f}",
                   f"{rs[0]['ratio']:.3f}", f"{statistics.median(r['transfer_s'] for r in rs) * 1e3:.2f}")
    con.print(t2)
    xfer = sum(r["transfer_s"] for r in per_req)
    con.print(f"transfers took {xfer:.3f} s of the pair's {lat_d['wall_s']:.2f} s; outputs equal: "
              f"{'yes' if same else 'NO'}. Both engines share this host's cores: correctness and accounting, "
              f"not a speed claim.")
    result = {"model": str(cfg.model.name), "backend": e.backend.name, "exec": "one process on the host CPU",
              "load_average": os.getloadavg()[0], "rows": rows, "requests": per_req, "outputs_equal": same,
              "transfer_s_total": xfer}
    out = write_json(cfg, "disagg.json", result)
    con.print(f"wrote {out}")
    return 0 if same else 1
