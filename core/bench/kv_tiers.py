"""``inferhal bench kv_tiers``: multi-turn sessions on a KV pool too small to keep them, with and without the tiers
behind the prefix cache (core/paging/tiers.py, offload.py).

``bench.kv_tiers.sessions`` sessions of ``bench.kv_tiers.turns`` turns run one request at a time through the offline
engine (no HTTP), their turns interleaved: turn t of every session, then turn t + 1. Turn 1 is a prefix every
session shares (``system_tokens``) and ``first_tokens`` of its own; each later turn is the session's whole history
(its earlier prompts and greedy answers of ``bench.max_tokens`` tokens) and ``turn_tokens`` new ones (a tool
result). Tokens are random ids of the model's vocabulary: the KV cache sees ids, not meaning. The pool
(``cache.num_blocks``; else ``cache.kv_cache_bytes`` split by the planner; else ``pool_sessions`` times the
longest request's blocks) holds fewer sessions than run, so by the time a session returns the others have evicted its blocks.

Variants (``bench.kv_tiers.variants``, :data:`VARIANTS`, defined in :mod:`.kv_tiers_report`), each an engine of its own over one loaded model:

- ``none``: the small pool alone (a returning turn recomputes what the pool lost);
- ``host``: + a host tier of ``cache.host_tier_bytes`` (4 GiB when 0);
- ``disk``: + a disk tier alone, in a fresh folder under ``cache.disk_tier_dir`` (the system's temporary folder
  when empty), capped at ``cache.disk_tier_bytes``, removed afterwards; ``host_disk``: both tiers;
- ``retain`` / ``host_retain``: window retention of hybrid models (``cache.retain_windows``, or one window per
  session when 0), alone or with the host tier; refused for a model without sliding-window groups;
- ``kept``: a pool that holds every session (a plain prefix hit: the bound a tier can approach).

Per turn: TTFT (from adding the request to its first token), prompt tokens found cached, of those the tokens a
tier restored (blocks restored × block size, in the group that restored most), tokens recomputed only to rebuild
windows (bounded replay), the tiers' restore seconds (taking blocks from a tier, a file read and check for the
disk tier, and writing them into the pool) and save seconds (the write-through copies, on the step thread).
:mod:`.kv_tiers_report` sums them per variant. Outputs: every turn's greedy tokens must equal the ``none``
variant's (each variant's answers build its own next prompts); logprobs bit-equal to ``kept``'s are counted.
Every turn runs on every variant's engine in turn, the order rotating turn by turn, so a change in the shared
host's load falls on all variants alike. ``bench.warmup`` requests (random, never reused) run on each engine
first; ``bench.repeats`` repeats draw fresh sessions on fresh engines.

JSON to ``output=`` (default ``<bench.output_dir>/kv_tiers.json``), ``kv_tiers.png`` beside it, a table readable
when piped; exit 1 when a variant's outputs differ from ``none``'s.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import os
import random
import shutil
import tempfile
import time
from typing import Any, Callable, Sequence

import torch

from inferhal.core.bench import write_json
from inferhal.core.bench.kv_tiers_report import VARIANTS
from inferhal.core.errors import UserError

#: variant → what it adds to the small pool
DEFAULT_HOST_BYTES = 4 << 30


@dataclasses.dataclass(frozen=True)
class Plan:
    """The sessions' shape (``bench.kv_tiers`` and ``bench.max_tokens``)."""

    sessions: int
    turns: int
    seed: int
    system: int
    first: int
    turn: int
    answer: int
    pool_sessions: float
    variants: tuple[str, ...]

    @property
    def longest(self) -> int:
        """Tokens of the longest request: the last turn's prompt and its answer."""
        return self.system + self.first + (self.turns - 1) * (self.answer + self.turn) + self.answer


def plan_of(cfg: Any) -> Plan:
    """The plan ``cfg`` asks for; bad values refused naming the field."""
    k = cfg.bench.kv_tiers
    for name, least in (("sessions", 1), ("turns", 2), ("first_tokens", 1), ("turn_tokens", 1),
                        ("system_tokens", 0)):
        if int(k[name]) < least:
            raise UserError(f"bench.kv_tiers.{name} must be >= {least}; got {k[name]}"
                            + (" (a session needs a turn that returns)" if name == "turns" else ""))
    if float(k.pool_sessions) < 1.0:
        raise UserError(f"bench.kv_tiers.pool_sessions must be >= 1 (the pool holds the longest request); "
                        f"got {k.pool_sessions}")
    variants = tuple(str(v) for v in k.variants)
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants or len(set(variants)) != len(variants):
        raise UserError(f"bench.kv_tiers.variants: {bad or list(variants)} — each once, of {', '.join(VARIANTS)}")
    if not cfg.cache.enable_prefix_caching:
        raise UserError("cache.enable_prefix_caching=false is refused by `inferhal bench kv_tiers`: it measures "
                        "prefix-cache hits (the tiers are behind the prefix cache)")
    if cfg.cache.kv_events_endpoint:
        raise UserError("cache.kv_events_endpoint is refused by `inferhal bench kv_tiers` (one engine per variant "
                        "and repeat, each would bind it): leave it empty")
    return Plan(int(k.sessions), int(k.turns), int(k.seed), int(k.system_tokens), int(k.first_tokens),
                int(k.turn_tokens), int(cfg.bench.max_tokens), float(k.pool_sessions), variants)


def pool_blocks(plan: Plan, block_size: int, num_blocks: int, kv_cache_bytes: int) -> tuple[int, int]:
    """(the small pool's blocks a group, the ``kept`` pool's): ``cache.num_blocks``; 0 with ``cache.kv_cache_bytes``
    set (the engine splits that budget: a window group gets room for the live windows of
    ``scheduler.max_num_seqs`` requests, where retention matters); else ``pool_sessions`` times the longest
    request's blocks. ``kept``: every session's blocks and the shared prefix's, twice over."""
    one = math.ceil(plan.longest / block_size)
    small = int(num_blocks) or (0 if int(kv_cache_bytes) else math.ceil(plan.pool_sessions * one))
    return small, 2 * (plan.sessions * one + math.ceil(plan.system / block_size)) + one


def cache_for(variant: str, cache: Any, plan: Plan, small: int, kept: int, folder: str) -> dict[str, Any]:
    """The ``cache.*`` values of one variant's engine."""
    over = {"num_blocks": kept if variant == "kept" else small, "host_tier_bytes": 0, "disk_tier_dir": "",
            "disk_tier_bytes": 0, "retain_windows": 0}
    if "host" in variant:
        over["host_tier_bytes"] = int(cache.host_tier_bytes) or DEFAULT_HOST_BYTES
    if "disk" in variant:
        over["disk_tier_dir"], over["disk_tier_bytes"] = folder, int(cache.disk_tier_bytes)
    if "retain" in variant:
        over["retain_windows"] = int(cache.retain_windows) or plan.sessions
    return over


def sessions_of(plan: Plan, repeat: int, vocab: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """(turn 1's prompt per session, the tokens each later turn adds per session) for one repeat."""
    lo, hi = _vocab_range(vocab)
    r = random.Random(f"kv_tiers:{plan.seed + repeat}")
    system = [r.randrange(lo, hi) for _ in range(plan.system)]
    firsts = [system + [r.randrange(lo, hi) for _ in range(plan.first)] for _ in range(plan.sessions)]
    adds = [[[r.randrange(lo, hi) for _ in range(plan.turn)] for _ in range(plan.turns - 1)]
            for _ in range(plan.sessions)]
    return firsts, adds


def _tier_tokens(before: dict, after: dict, specs: Sequence[Any], block_size: int) -> int:
    """Tokens a tier restored between two ``stats()``: the most blocks any group restored (a non-sliding one where
    the model has one: a window group restores only its window) × block size."""
    kinds = {s.name: s.kind for s in specs}
    delta = {g: n - before.get(g, 0) for g, n in after.items()}
    full = [n for g, n in delta.items() if kinds.get(g) != "sliding"]
    return max(full or list(delta.values()) or [0]) * block_size


def run_turn(engine: Any, prompt: list[int], params: Any) -> dict[str, Any]:
    """One request alone on ``engine``: its TTFT (wall clock, and the process's CPU time: on a busy shared host
the wall clock counts the time the process waited for a core), end-to-end time, cached/restored/replayed tokens, tier seconds,
    tokens and logprobs."""
    tiers = engine.kv_offload
    before = tiers.stats() if tiers is not None else None
    req = engine.make_request(prompt, params)
    t0, c0 = time.perf_counter(), time.process_time()
    rid = engine.add(req)
    ttft, cpu, done = None, None, None
    while done is None:
        for out in engine.step():
            if out.request_id != rid:
                continue
            if ttft is None and out.token_ids:
                ttft, cpu = time.perf_counter() - t0, time.process_time() - c0
            if out.finished:
                done = out
    e2e = time.perf_counter() - t0
    rec = {"prompt_tokens": len(prompt), "cached_tokens": int(done.num_cached_tokens),
           "replayed_tokens": int(done.num_replayed_tokens), "ttft_s": ttft if ttft is not None else e2e,
           "ttft_cpu_s": cpu if cpu is not None else time.process_time() - c0,
           "e2e_s": e2e, "tier_tokens": 0, "restore_s": 0.0, "save_s": 0.0,
           "tokens": list(done.token_ids), "logprobs": list(done.logprobs)}
    if tiers is not None:
        after = tiers.stats()
        rec["tier_tokens"] = _tier_tokens(before["restored_groups"], after["restored_groups"], engine.specs,
                                          engine.kv_manager.block_size)
        rec["restore_s"] = after["restore_s"] - before["restore_s"]
        rec["save_s"] = after["save_s"] - before["save_s"]
    return rec


def _vocab_range(vocab: int) -> tuple[int, int]:
    return (3, vocab - 3) if vocab < 4096 else (1000, vocab - 1000)


def run_sessions(engines: dict[str, Any], plan: Plan, repeat: int, warmup: int) -> list[dict[str, Any]]:
    """Warm-up requests on every engine, then every session's turns interleaved, each turn run on every variant's
    engine in turn (the order rotating turn by turn), so a change in the shared host's load falls on all variants
    alike; one record per variant and turn. A disk tier's queued writes finish after each of its turns, outside
    the timings."""
    from inferhal.core.sampling.params import SamplingParams

    vocab = int(next(iter(engines.values())).loaded.model.vocab_size)
    lo, hi = _vocab_range(vocab)
    sp = SamplingParams(max_tokens=plan.answer, temperature=0.0, ignore_eos=True, logprobs=1)
    r = random.Random(f"kv_tiers:warmup:{plan.seed + repeat}")
    for _ in range(warmup):
        prompt = [r.randrange(lo, hi) for _ in range(plan.first)]
        for engine in engines.values():
            run_turn(engine, prompt, sp)
    firsts, adds = sessions_of(plan, repeat, vocab)
    names = list(engines)
    history = {v: [list(p) for p in firsts] for v in names}
    out = []
    for t in range(plan.turns):
        for s in range(plan.sessions):
            k = (t * plan.sessions + s) % len(names)
            for v in names[k:] + names[:k]:
                if t:
                    history[v][s] += adds[s][t - 1]
                rec = run_turn(engines[v], history[v][s], sp)
                if engines[v].kv_offload is not None:
                    engines[v].kv_offload.flush()
                history[v][s] += rec["tokens"]
                out.append({"variant": v, "repeat": repeat, "session": s, "turn": t + 1, **rec})
    return out


def has_sliding(engine: Any) -> bool:
    return any(s.kind == "sliding" for s in engine.specs)


def _check(engine: Any, plan: Plan, model: str) -> None:
    retain = [x for x in plan.variants if "retain" in x]
    if retain and not has_sliding(engine):
        raise UserError(f"bench.kv_tiers.variants: {retain} keep sliding-window blocks; model {model!r} has no "
                        f"sliding-window group")
    if engine.max_model_len < plan.longest:
        raise UserError(f"the longest turn needs {plan.longest} tokens (bench.kv_tiers system_tokens + first_tokens + "
                        f"(turns - 1) x (bench.max_tokens + turn_tokens) + bench.max_tokens), past the engine's "
                        f"{engine.max_model_len} (model.max_model_len): make the sessions shorter")


def measure(cfg: Any, plan: Plan, repeats: int, warmup: int,
            progress: Callable[[str], None] = lambda s: None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every repeat: one engine per variant (over one loaded model), their turns interleaved
    (:func:`run_sessions`). → (the turn records, what the run was: pools, groups, tiers)."""
    from inferhal.core.engine.llm import LLM

    small, kept = pool_blocks(plan, int(cfg.cache.block_size), int(cfg.cache.num_blocks),
                              int(cfg.cache.kv_cache_bytes))
    loaded = backend = None
    records: list[dict[str, Any]] = []
    info: dict[str, Any] = {"pool_blocks": small, "kept_blocks": kept,
                            "pool": (f"a {small}-block pool" if small else
                                     f"a pool of cache.kv_cache_bytes={int(cfg.cache.kv_cache_bytes)}"),
                            "host_tier_bytes": int(cfg.cache.host_tier_bytes) or DEFAULT_HOST_BYTES, "pools": {}}
    for rep in range(repeats):
        engines: dict[str, Any] = {}
        folders: list[str] = []
        try:
            for v in plan.variants:
                folder = ""
                if "disk" in v:
                    base = str(cfg.cache.disk_tier_dir) or None
                    if base:
                        os.makedirs(base, exist_ok=True)
                    folder = tempfile.mkdtemp(prefix="inferhal-kv-tiers-", dir=base)
                    folders.append(folder)
                c = copy.deepcopy(cfg)
                for key, value in cache_for(v, cfg.cache, plan, small, kept, folder).items():
                    c.cache[key] = value
                engine = engines[v] = LLM.from_config(c, loaded, backend).engine
                loaded, backend = engine.loaded, engine.backend
                _check(engine, plan, str(cfg.model.name))
                info["pools"][v] = dict(engine.kv_manager.num_blocks)
            engine = engines[plan.variants[0]]
            info.update(block_size=engine.kv_manager.block_size, groups=[[s.name, s.kind] for s in engine.specs],
                        kv_bytes_per_token=sum(s.bytes_per_token() for s in engine.specs))
            t0 = time.perf_counter()
            recs = run_sessions(engines, plan, rep, warmup)
            records += recs
            for v in plan.variants:
                ret = [r for r in recs if r["variant"] == v and r["turn"] > 1]
                progress(f"[kv_tiers] repeat {rep + 1}/{repeats} {v}: returning turns cached "
                         f"{sum(r['cached_tokens'] for r in ret)}/{sum(r['prompt_tokens'] for r in ret)} tokens "
                         f"({sum(r['tier_tokens'] for r in ret)} from a tier), TTFT "
                         f"{sum(r['ttft_s'] for r in ret):.1f} s in all")
            progress(f"[kv_tiers] repeat {rep + 1}/{repeats}: {time.perf_counter() - t0:.1f} s")
        finally:
            for engine in engines.values():
                if engine.kv_offload is not None:
                    engine.kv_offload.close()
            engines = engine = None
            gc.collect()
            for folder in folders:
                shutil.rmtree(folder, ignore_errors=True)
    return records, info


def compare(records: Sequence[dict[str, Any]], reference: str = "none") -> dict[str, dict[str, Any]]:
    """Per variant: turns whose tokens differ from ``reference``'s (repeat, session, turn), and turns whose logprobs
    are bit-equal to ``kept``'s (None without a ``kept`` variant)."""
    by = {(r["variant"], r["repeat"], r["session"], r["turn"]): r for r in records}
    variants = sorted({r["variant"] for r in records})
    out = {}
    for v in variants:
        mine = [k for k in by if k[0] == v]
        differ = [list(k[1:]) for k in sorted(mine) if (reference, *k[1:]) in by
                  and by[k]["tokens"] != by[(reference, *k[1:])]["tokens"]]
        kept = None
        if any(k[0] == "kept" for k in by):
            kept = sum(1 for k in mine if ("kept", *k[1:]) in by and by[k]["logprobs"] == by[("kept", *k[1:])]["logprobs"])
        out[v] = {"turns": len(mine), "tokens_differ": differ, "logprobs_equal_kept": kept}
    return out


def run(cfg: Any) -> int:
    from inferhal.core.bench.kv_tiers_report import plot, summarize, table
    from inferhal.core.bench.stamp import stamp
    from inferhal.core.console import console as make_console

    console = make_console(min_width=150)
    plan = plan_of(cfg)
    load = os.getloadavg()
    repeats, warmup = int(cfg.bench.repeats), int(cfg.bench.warmup)
    records, info = measure(cfg, plan, repeats, warmup, progress=lambda s: console.print(s, highlight=False))
    checks = compare(records)
    rows = summarize(records, plan.variants)
    where = f"{cfg.model.name} ({cfg.model.dtype}) on backend {cfg.backend.name}"
    result = {"model": cfg.model.name, "dtype": str(cfg.model.dtype), "backend": cfg.backend.name,
              "settings": {**dataclasses.asdict(plan), "repeats": repeats, "warmup": warmup,
                           "async_scheduling": bool(cfg.scheduler.async_scheduling),
                           "deterministic": bool(cfg.get("deterministic", False))},
              **info, "variants": rows, "checks": checks,
              "turns": [{k: v for k, v in r.items() if k not in ("tokens", "logprobs")} for r in records],
              "torch_threads": torch.get_num_threads(), "load_average": [load, os.getloadavg()],
              "note": "offline engine, one request at a time; times are medians over repeats on a shared host",
              "stamp": stamp()}
    console.print(table(result, where))
    path = write_json(cfg, "kv_tiers.json", result)
    png = os.path.splitext(path)[0] + ".png"
    plot(result, png, where)
    console.print(f"wrote {path} and {png}", highlight=False)
    bad = {v: c["tokens_differ"] for v, c in checks.items() if c["tokens_differ"]}
    if bad:
        console.print(f"[red]outputs differ from the none variant's: {bad}[/red]")
        return 1
    return 0
