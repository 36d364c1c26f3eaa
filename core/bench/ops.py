"""``inferhal bench ops``: where a serving step's time goes, op by op.

On the configured model (``model.dtype``) and backend, at each ``bench.concurrency`` level ``c`` (default
1, 8, 32), the e2e benchmark's closed loop runs: ``n = max(c, min(bench.num_prompts, 4c))`` of its prompts,
``bench.max_tokens`` greedy tokens each (EOS ignored), ``c`` in flight. Each repeat runs it twice, in
alternating order:

- **plain**: only the wall time;
- **profiled**: every op call goes through a timer (:meth:`OpTable.intercept`). An op's time is its own:
  time spent in an op it calls through the table counts for that op. On a backend whose device is not the
  CPU each call is synchronised before and after (``torch.<device>.synchronize``), which takes away the
  overlap of host and device that a plain run has; the report says so.

Per op and level: calls per step, ms per step, share of the profiled wall, and the op's execution level
(a fallback shows as ``fallback``); the products (``linear``, ``lm_head``, ``lm_head.argmax``) also by
weight shape ``NxK``, each with the rate it reaches (``2 M N K`` flops over its own time; for
``lm_head.argmax`` the flops of the head it stands for, whatever it computes instead). **Outside ops** =
profiled wall − all ops' time: scheduling, the runner's batch building, Python between ops. **Overhead** =
profiled wall / plain wall: how much the timers themselves cost (median over repeats); the level's row is
the repeat with the median profiled wall.

Prefix caching is off (the runs repeat the same prompts, and each should prefill them all). A model
without a tokenizer gets token-id prompts of 8-16 ids instead. Steps are engine steps; at a level they mix
prefill (the first ``c`` requests' prompts) and decode.
Reported: a table per level, ``<bench.output_dir>/ops.json`` (or ``output=``) and ``ops.png`` (each level's
step split by op). Wall-clock times on whatever runs it: a CPU result on the CPU backends.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Sequence

import torch

from inferhal.core.bench import write_json

# the ops drawn on their own in the plot; the rest of the ops are one segment
PLOT_OPS = 8


#: ops whose time is also split by weight shape ``x [M, K] . w [N, K]^T``, with the rate they reach
PRODUCT_OPS = ("linear", "lm_head", "lm_head.argmax")


def product_shape(args) -> tuple[str, int] | None:
    """``("NxK", flops)`` of a product call ``(x, w, ...)`` with a 2-D weight (None otherwise)."""
    if len(args) < 2:
        return None
    x, shape = args[0], getattr(args[1], "shape", None)
    if shape is None or len(shape) != 2 or not hasattr(x, "numel"):
        return None
    n, k = int(shape[0]), int(shape[1])
    return f"{n}x{k}", 2 * (x.numel() // max(k, 1)) * n * k


class OpTimer:
    """``wrap`` for :meth:`OpTable.intercept`: per op, calls and own seconds (nested op calls excluded); for
    :data:`PRODUCT_OPS` also per weight shape (``parts[(op, "NxK")] = [calls, seconds, flops]``)."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync
        self.calls: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.parts: dict[tuple[str, str], list] = {}
        self._child = [0.0]  # per open call: time spent in the ops it called

    def reset(self) -> None:
        self.calls.clear()
        self.seconds.clear()
        self.parts.clear()
        self._child = [0.0]

    def __call__(self, entry):
        op_id, fn, sync = entry.op_id, entry.fn, self.sync
        product = op_id in PRODUCT_OPS

        def timed(*args, **kwargs):
            if sync is not None:
                sync()
            t = time.perf_counter()
            self._child.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                if sync is not None:
                    sync()
                dt = time.perf_counter() - t
                own = dt - self._child.pop()
                self.seconds[op_id] = self.seconds.get(op_id, 0.0) + own
                self.calls[op_id] = self.calls.get(op_id, 0) + 1
                self._child[-1] += dt
                shape = product_shape(args) if product else None
                if shape is not None:
                    part = self.parts.setdefault((op_id, shape[0]), [0, 0.0, 0])
                    part[0] += 1
                    part[1] += own
                    part[2] += shape[1]

        return timed


def device_sync(device: torch.device) -> Callable[[], None] | None:
    """``torch.<type>.synchronize`` for a non-CPU device (None on the CPU, or where torch has none)."""
    if device.type == "cpu":
        return None
    mod = getattr(torch, device.type, None)
    sync = getattr(mod, "synchronize", None)
    return sync if callable(sync) else None


def level_row(c: int, requests: int, tokens: int, plain: Sequence[float], profiled: Sequence[dict],
              levels: dict[str, str]) -> dict:
    """A level's row from its repeats: ``plain`` walls, ``profiled`` = [{wall, steps, calls, seconds,
    parts}] (``parts``: :attr:`OpTimer.parts`, optional)."""
    ranked = sorted(profiled, key=lambda r: r["wall"])
    rep = ranked[(len(ranked) - 1) // 2]
    steps = max(rep["steps"], 1)
    ops = [{"op": op, "level": levels.get(op, "?"), "calls_per_step": rep["calls"][op] / steps,
            "ms_per_step": s * 1e3 / steps, "share": s / rep["wall"]}
           for op, s in rep["seconds"].items()]
    for o in ops:  # products: their time by weight shape, and the rate each reaches (flops / own time)
        parts = [{"shape": shape, "calls_per_step": calls / steps, "ms_per_step": sec * 1e3 / steps,
                  "share": sec / rep["wall"], "gflops": fl / sec / 1e9 if sec > 0 else 0.0}
                 for (op, shape), (calls, sec, fl) in rep.get("parts", {}).items() if op == o["op"]]
        if parts:
            o["parts"] = sorted(parts, key=lambda q: -q["ms_per_step"])
    ops.sort(key=lambda o: -o["ms_per_step"])
    inside = sum(rep["seconds"].values())
    return {"concurrency": c, "requests": requests, "tokens": tokens, "steps": rep["steps"],
            "profiled_wall_s": rep["wall"], "plain_wall_s": statistics.median(plain),
            "step_ms": rep["wall"] * 1e3 / steps, "ops_ms_per_step": inside * 1e3 / steps,
            "outside_ms_per_step": (rep["wall"] - inside) * 1e3 / steps, "outside_share": 1 - inside / rep["wall"],
            "overhead": statistics.median(p["wall"] / q for p, q in zip(profiled, plain)),
            "tok_s_plain": tokens / statistics.median(plain), "ops": ops,
            "profiled_walls_s": [p["wall"] for p in profiled], "plain_walls_s": list(plain)}


def measure(llm, prompts: Sequence[list[int]], levels: Sequence[int], num_prompts: int, max_tokens: int,
            repeats: int, progress: Callable[[str], None] = lambda s: None, warmup: int = 1) -> list[dict]:
    """One :func:`level_row` per level (see the module docstring); before each level, ``warmup`` untimed
    runs of its first ``c`` prompts, 2 tokens each (first-call packing and allocation)."""
    from inferhal.core.bench.clients import run_inferhal

    table = llm.engine.loaded.model.ops
    timer = OpTimer(device_sync(llm.engine.device))
    exec_levels = table.provenance()
    rows = []
    for c in levels:
        n = max(c, min(num_prompts, 4 * c))
        for _ in range(warmup):
            run_inferhal(llm, prompts[:c], c, 2)
        plain: list[float] = []
        profiled: list[dict] = []
        for r in range(repeats):
            for timed in ((False, True) if r % 2 == 0 else (True, False)):
                steps: list[int] = []
                if timed:
                    timer.reset()
                    with table.intercept(timer):
                        wall, _ = run_inferhal(llm, prompts[:n], c, max_tokens, steps)
                    profiled.append({"wall": wall, "steps": steps[0], "calls": dict(timer.calls),
                                     "seconds": dict(timer.seconds),
                                     "parts": {k: list(v) for k, v in timer.parts.items()}})
                else:
                    wall, _ = run_inferhal(llm, prompts[:n], c, max_tokens)
                    plain.append(wall)
        row = level_row(c, n, n * max_tokens, plain, profiled, exec_levels)
        rows.append(row)
        top = ", ".join(f"{o['op']} {100 * o['share']:.0f}%" for o in row["ops"][:4])
        progress(f"c={c}: {row['steps']} steps, {row['step_ms']:.2f} ms/step profiled; {top}; outside ops "
                 f"{100 * row['outside_share']:.0f}%; timer overhead {row['overhead']:.2f}x")
    return rows


def run(cfg) -> int:
    from inferhal.core.console import console as make_console
    from rich.table import Table

    from inferhal.core.bench.clients import prompt_ids
    from inferhal.core.engine.llm import LLM

    console = make_console(min_width=110)
    b = cfg.bench
    levels = [int(c) for c in b.concurrency]
    num_prompts, max_tokens, repeats = int(b.num_prompts), int(b.max_tokens), max(1, int(b.repeats))
    cfg.scheduler.max_num_seqs = max(cfg.scheduler.max_num_seqs, max(levels))
    cfg.cache.enable_prefix_caching = False  # the runs repeat their prompts: each must prefill them all
    llm = LLM.from_config(cfg)
    sync = device_sync(llm.engine.device)
    where = f"{cfg.model.name} ({cfg.model.dtype}) on backend {cfg.backend.name}, device {llm.engine.device}"
    console.print(f"ops: {where}; " + ("each op call synchronised (host/device overlap removed)" if sync else
                                       "wall-clock per op call"))
    n_max = max(max(c, min(num_prompts, 4 * c)) for c in levels)
    if llm.tokenizer is not None:
        prompts = prompt_ids(llm.tokenizer, n_max)
    else:  # a checkpoint without a tokenizer (e.g. deepseek_v4_tiny): the engine benchmark's token-id prompts
        from inferhal.core.bench.engine import prompt

        vocab = int(llm.engine.loaded.model.vocab_size)
        prompts = [prompt(i, 8 + i % 9, vocab) for i in range(n_max)]
        console.print(f"  no tokenizer: {n_max} prompts of 8-16 token ids")
    rows = measure(llm, prompts, levels, num_prompts, max_tokens, repeats, lambda s: console.print(f"  {s}"),
                   warmup=int(b.warmup))

    for r in rows:
        table = Table(title=f"c={r['concurrency']}: {r['steps']} steps, {r['step_ms']:.2f} ms per step profiled, "
                            f"{r['tok_s_plain']:.1f} tok/s plain, timer overhead {r['overhead']:.2f}×")
        for col in ("op", "level", "calls/step", "ms/step", "share", "GFLOP/s"):
            table.add_column(col, justify="left" if col in ("op", "level") else "right")
        for o in r["ops"]:
            table.add_row(o["op"], o["level"], f"{o['calls_per_step']:.1f}", f"{o['ms_per_step']:.3f}",
                          f"{100 * o['share']:.1f}%", "")
            for q in o.get("parts", ()):
                table.add_row(f"  {q['shape']}", "", f"{q['calls_per_step']:.1f}", f"{q['ms_per_step']:.3f}",
                              f"{100 * q['share']:.1f}%", f"{q['gflops']:.0f}")
        table.add_row("(outside ops)", "", "", f"{r['outside_ms_per_step']:.3f}", f"{100 * r['outside_share']:.1f}%",
                      "")
        console.print(table)
    result = {"model": cfg.model.name, "dtype": str(cfg.model.dtype), "backend": cfg.backend.name,
              "device": str(llm.engine.device), "synchronised_per_op": sync is not None,
              "max_tokens": max_tokens, "repeats": repeats, "torch_threads": torch.get_num_threads(), "levels": rows}
    out = write_json(cfg, "ops.json", result)
    png = os.path.splitext(out)[0] + ".png"
    plot(rows, png, where)
    console.print(f"wrote {out} and {png}")
    return 0


def plot(rows: Sequence[dict], path: str, where: str) -> None:
    """One horizontal bar per level: ms per step, split into the largest ops, the other ops, outside ops."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    totals: dict[str, float] = {}
    for r in rows:
        for o in r["ops"]:
            totals[o["op"]] = totals.get(o["op"], 0.0) + o["share"]
    named = sorted(totals, key=lambda op: -totals[op])[:PLOT_OPS]
    segments = named + ["other ops", "outside ops"]
    palette = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 7]  # tab10's grey is for outside
    colors = dict(zip(named, palette))
    colors.update({"other ops": "0.85", "outside ops": "0.5"})
    fig, ax = plt.subplots(figsize=(8.0, 1.6 + 0.6 * len(rows)))
    labels = [f"c={r['concurrency']}" for r in rows]
    for i, r in enumerate(rows):
        ms = {o["op"]: o["ms_per_step"] for o in r["ops"]}
        parts = [ms.get(op, 0.0) for op in named]
        parts += [sum(v for op, v in ms.items() if op not in named), r["outside_ms_per_step"]]
        left = 0.0
        for seg, w in zip(segments, parts):
            ax.barh(i, w, left=left, color=colors[seg], label=seg if i == 0 else None, edgecolor="white", lw=0.5)
            left += w
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms per engine step (profiled)")
    ax.set_title(f"inferhal bench ops: {where}", fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
