"""Whole steps and whole engines on the device.

- ``graphs``: one decode step of the tiny V4 eager and replayed from the backend's graph runner (the first
  host synchronisation found by the device's ``forbid_host_sync`` guard, where it has one: what stops a
  capture), and the engine's own decode graphs against ``backend.graphs=false`` (same tokens, steps replayed).
- ``speed``: decode tok/s of the tiny V4 and Gemma 3 270M bf16 at c = 1, 8, 32, 64 (the e2e bench's closed
  loop), eager against graphs.
- ``peer``: transformers' eager ``generate`` on the same GGUF on the same device, where transformers is here.
- ``serve``: ``inferhal serve`` on the device under ``inferhal bench serve`` (TTFT, TPOT p50/p99 per level).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from inferhal.core.qualify.device_run.common import Context, error_text, log
from inferhal.core.qualify.device_run.numerics import TINY_PROMPTS

LEVELS = {"full": (1, 8, 32, 64), "reduced": (1, 2)}
TOKENS = {"full": 64, "reduced": 3}


def _runner_model(llm):
    eng = llm.engine
    runner = getattr(eng, "runner", None) or getattr(eng, "executor", None)
    return runner, getattr(runner, "model", None)


def graph_rows(ctx: Context, emit) -> None:
    import torch

    from inferhal.core.engine.llm import LLM
    from inferhal.core.qualify.device_run.common import QUICK, bench
    from inferhal.core.sampling.params import SamplingParams

    row = ctx.row("graphs", name="tiny V4 decode step", model="deepseek_v4_tiny", rows=len(TINY_PROMPTS))
    graphs = ctx.active.graph_runner()
    try:
        llm = LLM("deepseek_v4_tiny", backend=ctx.backend, overrides=[f"backend.interpret={str(ctx.interpret).lower()}",
                                                                      "backend.graphs=false"])
        _, model = _runner_model(llm)
        seen, orig = {}, model.forward

        def spy(batch, kv):
            if batch.input_ids.numel() == len(TINY_PROMPTS):  # a decode step of every sequence
                seen.setdefault("step", (batch, kv))
            return orig(batch, kv)

        model.forward = spy
        # logprobs: the runner calls forward (an all-greedy step without them takes forward_greedy)
        llm.generate(TINY_PROMPTS, SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, ignore_eos=True))
        model.forward = orig
        batch, kv = seen["step"]
        step = lambda: orig(batch, kv)  # noqa: E731
        eager_out = step().clone()
        quick = {} if ctx.on_device else QUICK
        row["eager_ms"] = bench(step, ctx.active.device, **quick)["ms"]
        row["first_host_sync"] = host_sync(ctx.active.device, step)
        row["core_host_reads"] = core_host_reads(step)
        if graphs is None:
            row.update(status="not-run", message=f"{ctx.backend} offers no graph runner at level {ctx.label}")
        else:
            try:
                replay = graphs.capture(step)
                out = replay()
                ctx.active.device.synchronize()
                row["graph_ms"] = bench(replay, ctx.active.device)["ms"]
                row["speedup"] = row["eager_ms"] / row["graph_ms"]
                row["graph_equals_eager"] = bool(torch.equal(out, eager_out))
                row["status"] = "pass" if row["graph_equals_eager"] else "fail"
            except Exception as exc:
                row.update(status="capture-failed", message=error_text(exc, 300))
    except Exception as exc:
        row.update(status="fail", message=error_text(exc, 800))
    log(f"{row['status']:>7} graphs: eager {row.get('eager_ms')} ms, graph {row.get('graph_ms')} ms {row.get('message', '')[:200]}")
    emit(row)
    emit(engine_graph_row(ctx))


def host_sync(device, fn) -> str:
    """The first host synchronisation ``fn`` makes, from the device's ``forbid_host_sync()`` guard (a context
    manager under which such a call raises), as the inferhal frames of the traceback, innermost last."""
    import traceback

    guard = getattr(device, "forbid_host_sync", None)
    if guard is None:
        return "not checked: the device object offers no forbid_host_sync guard"
    try:
        with guard():
            fn()
        return "no synchronising call"
    except Exception as exc:
        frames = [f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno} {f.name}: {(f.line or '').strip()[:120]}"
                  for f in traceback.extract_tb(exc.__traceback__) if "inferhal" in f.filename]
        return f"{type(exc).__name__}: {str(exc)[:200]} | " + " <- ".join(reversed(frames[-4:]))


def core_host_reads(fn) -> str:
    """What core's host-read guard (:mod:`inferhal.core.engine.host_sync`, device-independent: it runs in a dry
    run too) says of ``fn``: the first read that core or model code makes, else how often the backend's ops read."""
    from inferhal.core.engine.host_sync import HostSyncError, HostSyncGuard

    guard = HostSyncGuard()
    try:
        with guard:
            fn()
    except HostSyncError as exc:
        return f"core: {exc}"
    first = next(iter(guard.backend_reads), "")
    return (f"core and model code: none; the backend's ops: {sum(guard.backend_reads.values())} reads at "
            f"{len(guard.backend_reads)} places{f', first {first}' if first else ''}")[:400]


def _graph_stats(llm) -> dict:
    runner, _ = _runner_model(llm)
    g = getattr(runner, "graphs", None)
    if g is None:
        return {"graphs_replayed": 0, "graph_captures": 0, "graphs_disabled": "no graph runner"}
    return {"graphs_replayed": g.num_replays, "graph_captures": g.num_captures, "graphs_disabled": g.disabled}


def engine_graph_row(ctx: Context) -> dict:
    """The engine's decode graphs (``backend.graphs``) against ``backend.graphs=false``: same greedy tokens and
    logprobs, how many steps replayed, each bucket captured, or why capture failed."""
    from inferhal.core.engine.llm import LLM
    from inferhal.core.sampling.params import SamplingParams

    row = ctx.row("graphs", name="engine decode graphs", model="deepseek_v4_tiny")
    if ctx.active.graph_runner() is None:  # both runs would be eager: nothing to compare
        return dict(row, status="not-run", message=f"{ctx.backend} offers no graph runner at level {ctx.label}")
    try:
        sp = SamplingParams(max_tokens=12 if ctx.on_device else 3, temperature=0.0, logprobs=1, ignore_eos=True)
        outs = {}
        for on in (False, True):
            llm = LLM("deepseek_v4_tiny", backend=ctx.backend, overrides=[f"backend.graphs={str(on).lower()}",
                                                                          f"backend.interpret={str(ctx.interpret).lower()}"])
            t0 = time.perf_counter()
            got = llm.generate(TINY_PROMPTS, sp)
            ctx.active.device.synchronize()
            outs[on] = ([o.token_ids for o in got], [o.logprobs for o in got], time.perf_counter() - t0)
            if on:
                row.update(_graph_stats(llm))
        row.update(replayed_steps=row["graphs_replayed"], tokens_equal=outs[True][0] == outs[False][0],
                   seconds={"eager": outs[False][2], "graphs": outs[True][2]})
        row["status"] = ("pass" if row["tokens_equal"] and row["replayed_steps"] else
                         "eager" if row["tokens_equal"] else "fail")
    except Exception as exc:
        row.update(status="fail", message=error_text(exc, 800))
    log(f"{row['status']:>7} engine graphs: {row.get('replayed_steps')} steps replayed, {row.get('graphs_disabled') or ''}"[:300])
    return row


# ------------------------------------------------------------------------------------------------ tok/s

def _models(ctx: Context) -> list[tuple[str, list[str]]]:
    out = [("deepseek_v4_tiny", ["model.dtype=bfloat16"])]
    if ctx.gemma and os.path.exists(ctx.gemma):
        out.append(("gemma3_270m", ["model.dtype=bfloat16", f"model.path={ctx.gemma}", "model.package=null"]))
    return out


def _prompts(llm, n: int) -> list[list[int]]:
    from inferhal.core.bench.clients import prompt_ids

    if llm.tokenizer is not None:
        return prompt_ids(llm.tokenizer, n)
    return [TINY_PROMPTS[i % len(TINY_PROMPTS)] + [i + 1] for i in range(n)]


def speed_rows(ctx: Context, emit) -> None:
    from inferhal.core.bench.clients import run_inferhal
    from inferhal.core.engine.llm import LLM

    levels, tokens = LEVELS[ctx.scale], TOKENS[ctx.scale]
    if not ctx.gemma or not os.path.exists(ctx.gemma):
        emit(ctx.row("speed", model="gemma3_270m", status="not-run", message="the Gemma 3 270M GGUF is not on this machine"))
    for model, ov in _models(ctx):
        for mode in ("eager", "graphs"):
            base = ctx.row("speed", model=model, mode=mode, max_tokens=tokens)
            if mode == "graphs" and ctx.active.graph_runner() is None:  # backend.graphs=true would be refused
                emit(dict(base, status="not-run", message=f"{ctx.backend} offers no graph runner at level {ctx.label}"))
                continue
            try:
                llm = LLM(model, backend=ctx.backend, overrides=ov + [f"backend.graphs={str(mode == 'graphs').lower()}",
                                                                     f"backend.interpret={str(ctx.interpret).lower()}"])
            except Exception as exc:
                emit(dict(base, status="fail", message=error_text(exc)))
                continue
            for c in levels:
                row = dict(base, concurrency=c)
                if ctx.late(row, emit):
                    continue
                try:
                    prompts = _prompts(llm, c)
                    run_inferhal(llm, prompts, c, 2)  # warm-up: compiles and the bucket's capture
                    wall, per = run_inferhal(llm, prompts, c, tokens)
                    n = sum(p[2] for p in per)
                    row.update(status="measured" if ctx.on_device else "dry-run", tok_s=n / wall, wall_s=wall, tokens=n,
                               tpot_p50_ms=statistics.median(p[1] for p in per) * 1e3,
                               ttft_p50_ms=statistics.median(p[0] for p in per) * 1e3, **_graph_stats(llm))
                except Exception as exc:
                    row.update(status="fail", message=error_text(exc))
                log(f"{row['status']:>8} speed {model} {mode} c={c}: {row.get('tok_s', 0):.1f} tok/s "
                    f"{row.get('graphs_disabled') or ''}"[:300])
                emit(row)
            del llm


def peer_rows(ctx: Context, emit) -> None:
    """transformers' eager ``generate`` on the Gemma GGUF, on the same device, at the speed section's levels."""
    import importlib.util

    row = ctx.row("peer", model="gemma3_270m", engine="transformers", dtype="bfloat16")
    if importlib.util.find_spec("transformers") is None:
        emit(dict(row, status="not-run", message="transformers is not installed on this machine"))
        return
    if not ctx.gemma or not os.path.exists(ctx.gemma):
        emit(dict(row, status="not-run", message="the Gemma 3 270M GGUF is not on this machine"))
        return
    from inferhal.core.bench.clients import peer_loaders, run_transformers
    from inferhal.core.engine.llm import LLM

    try:
        t0 = time.perf_counter()
        model = peer_loaders(ctx.gemma, os.cpu_count() or 1, "bfloat16")["transformers"]().to(ctx.dev)
        row["load_s"] = time.perf_counter() - t0
        llm = LLM("gemma3_270m", backend="reference", overrides=[f"model.path={ctx.gemma}", "model.package=null"])
        pad = llm.tokenizer.eos_token_ids[0]
    except Exception as exc:
        emit(dict(row, status="fail", message=error_text(exc)))
        return
    for c in LEVELS[ctx.scale]:
        r = dict(row, concurrency=c)
        if ctx.late(r, emit):
            continue
        try:
            prompts = _prompts(llm, c)
            run_transformers(model, prompts, c, 2, pad)
            wall, per = run_transformers(model, prompts, c, TOKENS[ctx.scale], pad)
            n = sum(p[2] for p in per)
            r.update(status="measured" if ctx.on_device else "dry-run", tok_s=n / wall, wall_s=wall, tokens=n)
        except Exception as exc:
            r.update(status="fail", message=error_text(exc))
        log(f"{r['status']:>8} peer transformers c={c}: {r.get('tok_s', 0):.1f} tok/s")
        emit(r)


def serve_rows(ctx: Context, emit, out_dir: str) -> None:
    """``inferhal bench serve`` (a child process: the server in its own process, streaming clients on loopback)
    with the backend and Gemma 3 270M bf16; its JSON's levels become rows."""
    import importlib.util

    row = ctx.row("serve", model="gemma3_270m")
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        emit(dict(row, status="not-run", message=f"not installed on this machine: {', '.join(missing)}"))
        return
    if not ctx.gemma or not os.path.exists(ctx.gemma):
        emit(dict(row, status="not-run", message="the Gemma 3 270M GGUF is not on this machine"))
        return
    out = os.path.join(out_dir, "serve-bench.json")
    levels = [1, 8, 32] if ctx.on_device else [1]
    cmd = [sys.executable, "-m", "inferhal.core.cli.main", "bench", "serve", f"backend={ctx.backend}", "model=gemma3_270m",
           f"model.path={ctx.gemma}", "model.package=null", "model.dtype=bfloat16",
           f"backend.interpret={str(ctx.interpret).lower()}", f"bench.concurrency=[{','.join(map(str, levels))}]",
           f"bench.num_prompts={max(levels) * 2}", f"bench.max_tokens={TOKENS[ctx.scale]}", "bench.warmup=1",
           f"output={out}"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(10.0, ctx.left()))
        row["exit"] = p.returncode
        data = json.loads(open(out).read()) if os.path.exists(out) else {}
    except subprocess.TimeoutExpired:
        emit(dict(row, status="timeout", message="bench serve ran past the run's deadline"))
        return
    levels_out = data.get("rows") or []
    if not levels_out:
        emit(dict(row, status="fail", message=(p.stderr or p.stdout)[-800:]))
        return
    status = "measured" if ctx.on_device else "dry-run"
    for lv in levels_out:
        ms = {f"{name}_p{q}_ms": 1e3 * float(lv[key][str(q)]) for name, key in (("ttft", "ttft_s"), ("tpot", "itl_s"))
              for q in (50, 99)}
        emit(dict(row, concurrency=lv["concurrency"], tok_s=lv["server_tok_s"], offline_tok_s=lv["offline_tok_s"],
                  completed=lv["completed"], mismatched=lv["mismatched"],
                  status="fail" if lv["mismatched"] else status, **ms))
    if data.get("failures"):
        emit(dict(row, name="checks", status="fail", message="; ".join(data["failures"])[:800]))
