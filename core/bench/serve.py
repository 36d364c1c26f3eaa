"""``inferhal bench serve``: a load test of ``inferhal serve`` on loopback, against the offline engine.

For each ``bench.concurrency`` level ``c`` (e.g. ``bench.concurrency=[32,64]``), with
``bench.num_prompts`` greedy prompts of ``bench.max_tokens`` tokens:

1. **Offline**: the engine alone (``LLM``'s engine, ``c`` requests in flight, a new one added as one
   finishes, on a worker thread like the server's loop): output tokens per second, and each prompt's
   text, the reference.
2. **Server**: ``inferhal serve`` with the same config in a child process; ``c`` streaming clients
   (plain asyncio sockets, :mod:`.serve_client`) each send one prompt after another (both sides after
   ``bench.warmup`` short rounds). One client request in ``DISCONNECT_EVERY`` hangs up after a random
   number of events. Output tokens per second (every token the engine generated, from the server's
   ``inferhal_generation_tokens_total``, hung-up requests' included), TTFT and inter-token latency of the
   completed streams at p50/p95/p99.
3. **Checks**: every completed stream equals the offline text of its prompt (no lost, duplicated or
   reordered tokens; the reference backend is batch-invariant, so batching does not change greedy tokens),
   ends with ``[DONE]``, and at the end the server reports 0 running and waiting requests and 0 KV blocks
   in use (``/metrics``), after the disconnects. The exit status is 1 when a check fails.

The server's overhead is ``1 - server tok/s / offline tok/s`` at the same ``c`` in the same run (the target
is <= 10 % at c=32). Clients, server and engine share the host's CPUs: on a loaded 2-core machine the
numbers are indicative only. ``output=`` (default ``<bench.output_dir>/serve.json``) gets the JSON.
With ``parallel.dp > 1`` (``parallel=dep2``) it runs :mod:`.serve_dp` instead: a skewed multi-turn workload
against the DP placement policies and one colocated engine.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

from omegaconf import OmegaConf

from inferhal.core import procs
from inferhal.core.bench.scrape import get as _get, metric as _metric
from inferhal.core.bench.stamp import stamp
from inferhal.core.parallel.launch import free_port as _free_port  # (agent, agent_servers, soak import these three here)

DISCONNECT_EVERY = 10
_SUBJECTS = ["a lighthouse keeper", "a robot", "the river", "an old map", "a small cat", "the north wind",
             "a baker", "the last train", "a violin", "the moon"]


def prompts(n: int) -> list[str]:
    return [f"Story {i}: {_SUBJECTS[i % len(_SUBJECTS)]} and {_SUBJECTS[(i * 7 + 3) % len(_SUBJECTS)]}. "
            f"Once upon a time," for i in range(n)]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def offline(llm, texts: list[str], max_tokens: int, c: int) -> tuple[float, dict[int, str], int]:
    """(tok/s, prompt index → text, tokens) with ``c`` requests in flight, on a worker thread as the
    server's engine loop runs (on the loaded 2-core hosts torch steps on the main thread ran ~10x slower
    than on a worker thread, OpenMP teams spinning against each other: the comparison would be unfair)."""
    import threading

    box = []
    th = threading.Thread(target=lambda: box.append(_offline(llm, texts, max_tokens, c)))
    th.start()
    th.join()
    if not box:
        raise RuntimeError("the offline run failed (see the error above)")
    return box[0]


def _offline(llm, texts: list[str], max_tokens: int, c: int) -> tuple[float, dict[int, str], int]:
    from inferhal.core.sampling.params import SamplingParams

    eng, tok = llm.engine, llm.tokenizer
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    todo, rid_of, out, n_tok = list(range(len(texts))), {}, {}, 0
    t0 = time.perf_counter()
    while todo or eng.has_unfinished():
        while todo and len(rid_of) < c:
            i = todo.pop(0)
            rid_of[eng.add_request(texts[i], params)] = i
        for o in eng.step():
            n_tok += len(o.new_token_ids)
            if o.finished:
                out[rid_of.pop(o.request_id)] = tok.decode(o.token_ids, skip_special_tokens=True)
    return n_tok / (time.perf_counter() - t0), out, n_tok


def _serve_child(cfg, port: int) -> None:
    import sys

    from inferhal.core.server.serve import serve

    OmegaConf.update(cfg, "server.port", port, merge=False)
    OmegaConf.update(cfg, "server.host", "127.0.0.1", merge=False)
    sys.exit(serve(cfg))


async def _load(port: int, model: str, texts: list[str], max_tokens: int, c: int, seed: int):
    from inferhal.core.bench.serve_client import stream_completion

    rng = random.Random(seed)
    plan = [(i, rng.randint(1, max(1, max_tokens // 2)) if i % DISCONNECT_EVERY == DISCONNECT_EVERY - 1 else None)
            for i in range(len(texts))]
    queue, results = list(plan), {}

    async def client():
        while queue:
            i, hang = queue.pop(0)
            body = {"model": model, "prompt": texts[i], "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            results[i] = await stream_completion("127.0.0.1", port, body, hang)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(c)))
    return time.perf_counter() - t0, results


def run(cfg) -> int:
    from rich.table import Table

    from inferhal.core.console import console as make_console
    from inferhal.core.engine.llm import LLM
    from inferhal.core.server.serve import check_dp

    if check_dp(cfg) > 1:  # parallel=dep2: the skewed workload over DP ranks and their policies (serve_dp.py)
        from inferhal.core.bench.serve_dp import run_dp

        return run_dp(cfg)

    con = make_console(min_width=160)
    b = cfg.bench
    levels = [int(c) for c in b.concurrency]
    n, max_tokens = int(b.num_prompts), int(b.max_tokens)
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    OmegaConf.update(cfg, "scheduler.max_num_seqs", max(int(cfg.scheduler.max_num_seqs), max(levels)), merge=False)
    OmegaConf.update(cfg, "server.max_queued_requests", max(int(cfg.server.max_queued_requests), 2 * max(levels)),
                     merge=False)
    model = str(cfg.server.served_model_name or cfg.model.name)
    texts = prompts(n)
    con.print(f"[bench serve] {model}: {n} prompts x {max_tokens} greedy tokens at concurrency {levels}; offline first",
              highlight=False)
    llm = LLM.from_config(cfg)
    if int(b.warmup):  # first steps pay one-time costs (kernel probes, allocator growth)
        offline(llm, texts[:max(levels)], 4, max(levels))
    offline_rows = {}
    for c in levels:
        tps, ref, ntok = offline(llm, texts, max_tokens, c)
        offline_rows[c] = tps
        con.print(f"  offline c={c}: {ntok} tokens, {tps:.1f} tok/s", highlight=False)
    del llm
    port = _free_port()
    proc = procs.context().Process(target=_serve_child, args=(cfg, port), daemon=False)
    proc.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while _get(base + "/health")[0] != 200:
        if not proc.is_alive() or time.monotonic() > deadline:
            con.print("[bench serve] the server did not start", highlight=False)
            proc.kill()
            return 1
        time.sleep(0.2)
    rows, failures, end = [], [], {}
    try:
        if int(b.warmup):
            asyncio.run(_load(port, model, texts[:max(levels)], 4, max(levels), seed=0))
        for c in levels:
            gen0 = _metric(_get(base + "/metrics")[1], "inferhal_generation_tokens_total")
            wall, res = asyncio.run(_load(port, model, texts, max_tokens, c, seed=c))
            time.sleep(0.5)  # the hung-up requests' aborts reach the engine loop and are counted
            gen = _metric(_get(base + "/metrics")[1], "inferhal_generation_tokens_total") - gen0
            done = {i: r for i, r in res.items() if not r.disconnected}
            bad = [i for i, r in done.items() if r.status != 200 or not r.done or r.error or r.text != ref[i]]
            ttft = [r.first - r.start for r in done.values() if r.first]
            itl = [t1 - t0 for r in done.values() for t0, t1 in zip(r.times, r.times[1:])]
            toks = sum(r.completion_tokens for r in done.values())
            tps = gen / wall  # every token the engine generated, the hung-up requests' too (as offline counts)
            row = {"concurrency": c, "requests": len(res), "completed": len(done),
                   "disconnected": len(res) - len(done), "mismatched": len(bad), "server_tok_s": tps,
                   "offline_tok_s": offline_rows[c], "overhead": 1 - tps / offline_rows[c],
                   "ttft_s": {q: pct(ttft, q) for q in (50, 95, 99)}, "itl_s": {q: pct(itl, q) for q in (50, 95, 99)}}
            rows.append(row)
            if bad:
                failures.append(f"c={c}: {len(bad)} streams differ from the offline text (first: prompt {bad[0]}: "
                                f"{done[bad[0]].text!r} vs {ref[bad[0]]!r} {done[bad[0]].error})")
            con.print(f"  server c={c}: {gen:.0f} tokens ({toks} in completed streams) in {wall:.1f} s, {tps:.1f} tok/s; "
                      f"{len(done)} completed, "
                      f"{len(res) - len(done)} hung up, {len(bad)} mismatched", highlight=False)
        time.sleep(1.0)  # the last aborts reach the engine loop
        _, metrics = _get(base + "/metrics")
        end = {k: _metric(metrics, f"inferhal_{k}") for k in ("num_requests_running", "num_requests_waiting",
                                                              "kv_cache_usage_ratio")}
        if any(v != 0 for v in end.values()):
            failures.append(f"at the end the server reports {end} (want all 0)")
    finally:
        proc.terminate()  # SIGTERM: graceful, exit 0
        proc.join(60)
    if proc.exitcode != 0:
        failures.append(f"the server exited {proc.exitcode} after SIGTERM (want 0)")
    table = Table(title=f"inferhal serve vs the offline engine: {model}, {n} prompts x {max_tokens} tokens, "
                        f"backend {cfg.backend.name} (a shared, loaded host: indicative)")
    for col in ("c", "offline tok/s", "server tok/s", "overhead", "TTFT p50/p95/p99 ms", "ITL p50/p95/p99 ms",
                "completed", "hung up", "mismatched"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["concurrency"]), f"{r['offline_tok_s']:.1f}", f"{r['server_tok_s']:.1f}",
                      f"{100 * r['overhead']:.1f}%", "/".join(f"{1000 * r['ttft_s'][q]:.0f}" for q in (50, 95, 99)),
                      "/".join(f"{1000 * r['itl_s'][q]:.0f}" for q in (50, 95, 99)), str(r["completed"]),
                      str(r["disconnected"]), str(r["mismatched"]))
    con.print(table)
    con.print(f"end state: {end}; server exit status {proc.exitcode}", highlight=False)
    for f in failures:
        con.print(f"FAIL {f}", highlight=False)
    out = Path(str(cfg.get("output") or Path(str(b.output_dir)) / "serve.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": model, "backend": str(cfg.backend.name), "num_prompts": n,
                               "max_tokens": max_tokens, "rows": rows, "end_state": end,
                               "server_exit": proc.exitcode, "failures": failures,
                               "note": "clients, server and engine on one shared host", "stamp": stamp()}, indent=1))
    con.print(f"wrote {out}", highlight=False)
    return 1 if failures else 0
