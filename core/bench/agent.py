"""``inferhal bench agent``: multi-turn agent sessions replayed against OpenAI-compatible servers, a concurrency
sweep per server, and Pareto curves of throughput per device against throughput per user.

The workload (:mod:`.agent_sessions`): sessions generated from ``bench.agent.seed`` (a shared system prompt
with tool schemas as text, a task, tool results of drawn lengths, think times, a salt per replayed copy) or a
JSONL trace (``bench.agent.trace``). The users (:mod:`.agent_client`): at each ``bench.concurrency`` level
``c``, ``c`` asyncio users over the ``openai`` client replay sessions turn by turn (streamed chat
completions) for ``bench.agent.turns_per_point`` turns in all, after ``bench.warmup`` warm-up turns per
server. What is reported (:mod:`.agent_report`): TTFT / TPOT / ITL / E2E at p50, p90, p99, output and total
tok/s, tok/s per user, tokens per chunk, prefix-hit rate and drafts accepted from the server's ``/metrics``,
goodput under ``bench.agent.slo_ttft_ms`` / ``slo_tpot_ms``.

The servers, measured one after another (never two at once: they would share the cores):

- each ``bench.agent.variants`` entry (label → overrides) as an ``inferhal serve`` child with this config and
  those changes: ``bench=agent`` selects ``conf/bench/agent.yaml``, the set measured in docs/performance.md
  (off, ``spec=ngram``, ``spec=suffix``); more with ``"+bench.agent.variants.avx512=['backend=cpu_avx512']"``
  (a mapping: ``+``, and quotes around overrides). No variants and no ``bench.url``: one child with this config;
- ``bench.url``: a server already running (any OpenAI-compatible one), as it is;
- ``bench.peers: [llama_cpp]``: llama.cpp's OpenAI server (llama-cpp-python, installed from the wheel
  cached under ``~/.cache/inferhal/wheels``, see :mod:`.agent_servers`) on the same GGUF, with as many
  threads as torch uses. It serves one request at a time, so at ``c`` > 1 its users queue.

With ``bench.agent.drafter_cost`` the recorded turns of the first server are replayed through the suffix
and n-gram drafters without a model (:mod:`.agent_drafter`): their host time per request and decode step,
against the step time the servers measured, and the tokens a greedy step would give (suffix also from the
request's own tokens only, n-gram also with suffix's draft length). ``output=`` (default
``<bench.output_dir>/agent.json``) gets the JSON (with its :func:`~inferhal.core.bench.stamp.stamp`) and,
beside it, ``agent.png`` with the curves (commit, host and date in a corner). Clients and servers share the
host: on a shared machine the numbers hold as ratios within one run.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

from omegaconf import OmegaConf

from inferhal.core.bench import write_json
from inferhal.core.bench.agent_client import run_point
from inferhal.core.bench.agent_report import COUNTERS, plot, summarize, table
from inferhal.core.bench.agent_servers import gguf_path, running, start_inferhal, start_llama_cpp, stop, variant_config
from inferhal.core.bench.agent_sessions import generate, load_trace
from inferhal.core.bench.serve import _get, _metric
from inferhal.core.bench.stamp import stamp
from inferhal.core.errors import UserError

PEERS = ("llama_cpp",)


def check(a: Any, peers: list[str]) -> None:
    """``bench.agent`` and ``bench.peers`` as this bench reads them, refused with the field named."""
    for name in ("sessions", "turns", "turns_per_point"):
        if int(a[name]) < 1:
            raise UserError(f"bench.agent.{name} must be >= 1; got {a[name]}")
    if int(a.system_words) < 0:
        raise UserError(f"bench.agent.system_words must be >= 0; got {a.system_words}")
    for name, least in (("tool_result_words", 1), ("output_tokens", 1), ("think_s", 0)):
        vals = list(a[name])
        if not vals or any(v < least for v in vals):
            raise UserError(f"bench.agent.{name}: needs one or more values, each >= {least}; got {vals}")
    if float(a.temperature) < 0:
        raise UserError(f"bench.agent.temperature must be >= 0; got {a.temperature}")
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        if float(a[name]) <= 0:
            raise UserError(f"bench.agent.{name} must be > 0; got {a[name]}")
    for p in peers:
        if p not in PEERS:
            raise UserError(f"bench.peers: bench agent runs the peers {list(PEERS)} (an OpenAI server each); got {p!r}")


def _counters(url: str) -> dict[str, float]:
    text = _get(url + "/metrics")[1]
    return {k: _metric(text, name) for k, name in COUNTERS.items()}


def _caption(st: dict) -> str:
    """The plot's corner: the commit, host and date of the result's stamp (core/bench/stamp.py)."""
    h = st["host"]
    return f"commit {st['commit'][:12]}, {h['cpu']} ({h['logical_cpus']} CPUs), {st['date'][:16]} UTC"


def _stamp() -> str:
    """The corner text for a result made now (bench soak's JSON keeps it as its stamp)."""
    return _caption(stamp())


def _point(srv, sessions, c: int, rep: int, offset: int, a, con) -> dict:
    """One point: ``c`` users on ``srv`` for the point's turns, from session ``offset`` on (salts drawn afresh
    for each repeat, so a repeat finds no prefix of an earlier one)."""
    before = _counters(srv.url) if srv.metrics else None
    wall, res = asyncio.run(run_point(srv.url, srv.model, sessions, c, int(a.turns_per_point), float(a.temperature),
                                      seed=(int(a.seed) * 1000 + c) * 100 + rep, offset=offset))
    diff = {k: v - before[k] for k, v in _counters(srv.url).items()} if srv.metrics else None
    row = summarize(srv.label, c, wall, res, diff, float(a.slo_ttft_ms), float(a.slo_tpot_ms))
    row["repeat"], row["_results"], row["_counters"] = rep, res, diff
    con.print(f"  {srv.label} c={c} #{rep}: {row['completed']}/{row['turns']} turns in {wall:.1f} s, "
              f"{row['output_tok_s']:.1f} out tok/s, TPOT p50 {row['tpot_ms']['p50']:.0f} ms, "
              f"{row['tokens_per_chunk'] or 0:.2f} tok/chunk", highlight=False)
    return row


def _turns(row: dict) -> list[dict]:
    """Each turn of a row, compact (the JSON keeps them: paired comparisons between servers)."""
    return [{"user": r.user, "session": r.session, "turn": r.turn, "prompt_tokens": r.prompt_tokens,
             "output_tokens": r.output_tokens, "chunks": len(r.times), "error": r.error or None,
             "ttft_ms": round(1e3 * (r.first - r.start), 1) if r.first else None,
             "e2e_ms": round(1e3 * (r.end - r.start), 1)} for r in row["_results"]]


def _medians(reps: list[dict], servers: list[str]) -> tuple[list[dict], list[dict]]:
    """Per server and level the repeat with the median output tok/s (its repeats' key numbers beside it), and
    per level the median over repeats of each server's ratios to the first server's (paired by repeat)."""
    import statistics

    rows, ratios = [], []
    levels = sorted({r["concurrency"] for r in reps})
    for name in servers:
        for c in levels:
            rs = sorted((r for r in reps if r["server"] == name and r["concurrency"] == c),
                        key=lambda r: r["output_tok_s"])
            if rs:
                row = dict(rs[(len(rs) - 1) // 2])
                row["repeats"] = [{"output_tok_s": r["output_tok_s"], "tpot_p50_ms": r["tpot_ms"]["p50"],
                                   "ttft_p50_ms": r["ttft_ms"]["p50"], "tokens_per_chunk": r["tokens_per_chunk"]}
                                  for r in sorted(rs, key=lambda r: r["repeat"])]
                rows.append(row)
    base = servers[0] if servers else None
    for name in servers[1:]:
        for c in levels:
            pairs = [(r, b) for r in reps for b in reps if r["server"] == name and b["server"] == base
                     and r["concurrency"] == b["concurrency"] == c and r["repeat"] == b["repeat"]]
            got = {}
            for key, get in (("output_tok_s", lambda r: r["output_tok_s"]), ("tpot_p50", lambda r: r["tpot_ms"]["p50"]),
                             ("ttft_p50", lambda r: r["ttft_ms"]["p50"])):
                vals = [get(r) / get(b) for r, b in pairs if get(b) and get(r) == get(r)]
                got[key] = statistics.median(vals) if vals else None
            if pairs:
                ratios.append({"server": name, "baseline": base, "concurrency": c, "repeats": len(pairs), **got})
    return rows, ratios


def _tokenizer(cfg) -> Any:
    """The model's tokenizer (loaded with the model, a small KV cache and no drafter), or None if it has none."""
    from inferhal.core.config.schema import SpecConfig
    from inferhal.core.engine.llm import LLM

    small = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    OmegaConf.update(small, "cache.num_blocks", 16, merge=False)
    OmegaConf.update(small, "spec", OmegaConf.structured(SpecConfig()), merge=False)
    return LLM.from_config(small).tokenizer


def _count_inputs(rows: list[dict], tok: Any, a: Any) -> None:
    """Rows of a server that sent no usage (llama-cpp-python streams none): their turns' prompt tokens counted
    with the model's tokenizer and chat template, the row summarized again."""
    for i, row in enumerate(rows):
        if row["input_tokens"] is not None:
            continue
        for r in row["_results"]:
            if r.ok and r.prompt_tokens is None:
                r.prompt_tokens = len(tok.encode(tok.apply_chat_template(r.messages, add_generation_prompt=True),
                                                 add_bos=False))
        new = summarize(row["server"], row["concurrency"], row["wall_s"], row["_results"], row["_counters"],
                        float(a.slo_ttft_ms), float(a.slo_tpot_ms))
        rows[i] = {**row, **new, "input_tokens_from": "the bench's tokenizer (the server sent no usage)"}


def _drafter_cost(cfg, rows: list[dict], tok: Any, con) -> dict:
    """The drafters replayed over the first server's turns (its row at each level, in the order they ran): suffix
    as measured, suffix from the request's own tokens only, n-gram as measured and n-gram with suffix's ``k``
    (drafts as long as suffix's may be: the stores compared, not the draft lengths)."""
    from inferhal.core.bench.agent_drafter import replay, tokenized
    from inferhal.core.config.schema import SpecConfig
    from inferhal.core.spec.ngram import NgramProposer
    from inferhal.core.spec.suffix import SuffixProposer

    first = rows[0]["server"]
    res = sorted((r for row in rows if row["server"] == first for r in row["_results"] if r.ok and r.text),
                 key=lambda r: r.start)
    turns = tokenized(tok, [(r.messages, r.text) for r in res])
    out = {"turns": len(turns), "server": first}
    k = int(variant_config(cfg, ["spec=suffix"]).spec.num_speculative_tokens)
    for name, cls, ov in (("suffix", SuffixProposer, ["spec=suffix"]),
                          ("suffix_own", SuffixProposer, ["spec=suffix", "spec.suffix_max_cached_requests=0"]),
                          ("ngram", NgramProposer, ["spec=ngram"]),
                          (f"ngram_k{k}", NgramProposer, ["spec=ngram", f"spec.num_speculative_tokens={k}"])):
        spec = SpecConfig(**OmegaConf.to_container(variant_config(cfg, ov).spec))  # as conf/spec/*.yaml set them
        out[name] = {"overrides": ov, **replay(cls.from_config(spec), turns)}
        con.print(f"  drafter {name}: {out[name]['host_us_p50']:.0f} us per request-step (median), "
                  f"{out[name]['tokens_per_step'] or 0:.2f} tokens per step replayed", highlight=False)
    return out


def run(cfg) -> int:
    from inferhal.core.console import console

    con = console(min_width=200)
    b, a = cfg.bench, cfg.bench.agent
    peers = [str(p) for p in b.peers]
    check(a, peers)
    sessions = load_trace(str(a.trace)) if a.trace else generate(
        int(a.seed), int(a.sessions), int(a.turns), int(a.system_words), list(a.tool_result_words),
        list(a.output_tokens), list(a.think_s))
    levels = [int(c) for c in b.concurrency]
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for path, least in (("scheduler.max_num_seqs", max(levels)), ("server.max_queued_requests", 2 * max(levels))):
        OmegaConf.update(cfg, path, max(int(OmegaConf.select(cfg, path)), least), merge=False)
    variants = dict(a.variants) if a.variants else ({} if b.url else {str(cfg.model.name): []})
    starts = [(label, lambda ov=list(ov), label=label: start_inferhal(variant_config(cfg, ov), label))
              for label, ov in variants.items()]
    if b.url:
        starts.append(("url", lambda: running(str(b.url), str(cfg.server.served_model_name or cfg.model.name))))
    if "llama_cpp" in peers:
        import torch

        starts.append(("llama_cpp", lambda: start_llama_cpp(gguf_path(cfg), torch.get_num_threads(),
                                                            int(cfg.model.max_model_len))))
    n_turns = sum(len(s.turns) for s in sessions)
    # each point starts at its own block of sessions (the same for every server): a block holds what a point can
    # start (its turns, plus one partial session per user), the warm-up the last one
    block, points = int(a.turns_per_point) + max(levels), len(levels) * int(b.repeats)
    con.print(f"[bench agent] {len(sessions)} sessions ({n_turns} turns), {a.turns_per_point} turns per point at "
              f"concurrency {levels}; servers: {', '.join(s for s, _ in starts)}", highlight=False)
    if not a.trace and len(sessions) < (points + 1) * block:
        con.print(f"  sessions repeat across points (copies with other salts, whose greedy outputs suffix decoding's "
                  f"recent store has seen): bench.agent.sessions={(points + 1) * block} replays each once",
                  highlight=False)
    servers, notes, reps = [], {}, []
    try:
        for label, start in starts:  # every server up first: the levels then run interleaved across them
            srv, why = start()
            if srv is None:
                notes[label] = f"not measured: {why}"
                con.print(f"  {label}: {notes[label]}", highlight=False)
                continue
            srv.metrics = srv.has_metrics
            servers.append(srv)
            if int(b.warmup):
                asyncio.run(run_point(srv.url, srv.model, sessions, 1, int(b.warmup), float(a.temperature), seed=-1,
                                      offset=points * block))
        for i, c in enumerate(levels):
            for rep in range(int(b.repeats)):  # the servers in turn, rotated each repeat: a slow spell hits all
                for srv in servers[rep % len(servers):] + servers[: rep % len(servers)] if servers else []:
                    reps.append(_point(srv, sessions, c, rep, (i * int(b.repeats) + rep) * block, a, con))
    finally:
        for srv in servers:
            code = stop(srv)
            if code not in (None, 0) and not (srv.kind == "llama_cpp" and code == -signal.SIGTERM):  # uvicorn's way
                notes[srv.label] = f"the server exited {code} after SIGTERM"
    rows, ratios = _medians(reps, [srv.label for srv in servers])
    tok = _tokenizer(cfg) if rows and (a.drafter_cost or any(r["input_tokens"] is None for r in rows)) else None
    if tok is not None:
        _count_inputs(rows, tok, a)
    drafter = _drafter_cost(cfg, rows, tok, con) if a.drafter_cost and tok is not None else None
    con.print(table(rows, f"bench agent: {cfg.model.name}, {len(sessions)} sessions, {a.turns_per_point} turns per "
                          f"point, median of {b.repeats} repeats (clients and servers on one shared host)"))
    for r in ratios:
        con.print(f"{r['server']} / {r['baseline']} at c={r['concurrency']} (median of {r['repeats']} paired repeats): "
                  f"output tok/s x{r['output_tok_s'] or float('nan'):.2f}, TPOT p50 x{r['tpot_p50'] or float('nan'):.2f}, "
                  f"TTFT p50 x{r['ttft_p50'] or float('nan'):.2f}", highlight=False)
    for label, note in notes.items():
        con.print(f"{label}: {note}", highlight=False)
    st = stamp()
    payload = {"model": str(cfg.model.name), "stamp": st, "levels": levels, "sessions": len(sessions),
               "turns_per_point": int(a.turns_per_point), "variants": {k: list(v) for k, v in variants.items()},
               "rows": [{**{k: v for k, v in r.items() if not k.startswith("_")}, "turn_records": _turns(r)}
                        for r in rows],
               "ratios": ratios, "repeats": int(b.repeats), "notes": notes, "drafter_cost": drafter,
               "note": "clients and servers on one host; each row is the repeat with the median output tok/s"}
    out = write_json(cfg, "agent.json", payload)
    png = os.path.splitext(out)[0] + ".png"
    if rows:
        plot(rows, png, f"bench agent: {cfg.model.name} (tok/s per device vs tok/s per user)", _caption(st))
    con.print(f"wrote {out}" + (f" and {png}" if rows else ""), highlight=False)
    # the exit status: 1 when a server could not be measured or a turn failed
    return 0 if rows and not notes and not any(r["failed"] for r in rows) else 1
