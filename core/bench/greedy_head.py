"""``inferhal bench greedy_head``: a greedy step's head, as logits then argmax against ``lm_head.argmax``.

On the configured model (default Gemma 3 270M, in ``model.dtype``) and backend, the real final hidden
states are captured first: the e2e benchmark's prompts run greedy through the engine (``bench.max_tokens``
tokens each) and every row that reaches ``lm_head.argmax`` is kept. Then, at each ``bench.concurrency``
level ``m`` (default 1, 8, 32), windows of ``m`` captured rows run through:

- **logits**: the backend's ``lm_head`` into a reused fp32 buffer, then its ``sample`` on greedy rows
  (what a greedy step cost before ``lm_head.argmax``: the runner's buffer and ``sample``'s greedy rows);
- **greedy**: the backend's ``lm_head.argmax``.

Each repeat times both on the same window back to back, in alternating order; a level's time is the
median over ``bench.repeats`` windows, its ratio the median per-window ratio. The tokens must be equal on
every window (a mismatch is reported and fails the run).

Reported: a table, ``<bench.output_dir>/greedy_head.json`` (or ``output=``) and ``greedy_head.png``.
Wall-clock times on this machine's backend (a CPU result on the CPU backends).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Sequence

import torch

from inferhal.core.bench import write_json
from inferhal.core.ops.params import SampleBatch


def capture(llm, prompts: Sequence[str], max_tokens: int) -> torch.Tensor:
    """The hidden rows ``[R, K]`` that reach ``lm_head.argmax`` while ``prompts`` run greedy."""
    from inferhal.core.sampling.params import SamplingParams

    seen: list[torch.Tensor] = []

    def spy(entry):
        def call(x, w, *a, **kw):
            seen.append(x.detach().clone())
            return entry.fn(x, w, *a, **kw)
        return call

    with llm.engine.loaded.model.ops.intercept(spy, ["lm_head.argmax"]):
        llm.generate(list(prompts), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    if not seen:
        raise RuntimeError("bench greedy_head: no step reached lm_head.argmax (does the model have forward_greedy, "
                           "and is the backend's lm_head.argmax native or its lm_head the reference's?)")
    return torch.cat(seen)


def measure(logits_fn: Callable, greedy_fn: Callable, hidden: torch.Tensor, levels: Sequence[int], repeats: int,
            progress: Callable[[str], None] = lambda s: None) -> list[dict]:
    """One row per level: ``logits_ms``, ``greedy_ms`` (medians), ``ratio`` (median of logits / greedy per
    window), ``mismatches`` (windows whose tokens differ) and each window's times."""
    out = []
    for m in levels:
        t_log, t_gr, bad = [], [], 0
        for r in range(repeats):
            idx = [(r * m + i) % hidden.shape[0] for i in range(m)]
            x = hidden[idx].contiguous()
            a = b = None
            for first in ((True, False) if r % 2 == 0 else (False, True)):
                t = time.perf_counter()
                if first:
                    a = logits_fn(x)
                    t_log.append(time.perf_counter() - t)
                else:
                    b = greedy_fn(x)
                    t_gr.append(time.perf_counter() - t)
            bad += int(not torch.equal(a, b))
        row = {"rows": m, "logits_ms": statistics.median(t_log) * 1e3, "greedy_ms": statistics.median(t_gr) * 1e3,
               "ratio": statistics.median(x / y for x, y in zip(t_log, t_gr)), "mismatches": bad,
               "logits_repeat_ms": [t * 1e3 for t in t_log], "greedy_repeat_ms": [t * 1e3 for t in t_gr]}
        out.append(row)
        progress(f"{m} rows: logits + argmax {row['logits_ms']:.2f} ms, lm_head.argmax {row['greedy_ms']:.2f} ms, "
                 f"{row['ratio']:.2f}x" + (f", {bad} MISMATCHED windows" if bad else ""))
    return out


def run(cfg) -> int:
    from inferhal.core.console import console as make_console
    from rich.table import Table

    from inferhal.core.bench.clients import PROMPTS
    from inferhal.core.engine.llm import LLM

    console = make_console(min_width=110)
    b = cfg.bench
    levels = [int(c) for c in b.concurrency]
    repeats = max(3, int(b.repeats) * 5)  # one window per repeat: more of them than e2e's repeats
    cfg.scheduler.max_num_seqs = max(cfg.scheduler.max_num_seqs, len(PROMPTS))
    llm = LLM.from_config(cfg)
    model = llm.engine.loaded.model
    ops, head = model.ops, getattr(model, "embed_table", None)
    if head is None:
        head = getattr(model, "lm_head")
    where = f"{cfg.model.name} ({cfg.model.dtype}) on backend {cfg.backend.name}"
    console.print(f"greedy_head: {where}; lm_head.argmax: {ops.entry('lm_head.argmax').note or 'reference'}")
    hidden = capture(llm, PROMPTS, int(b.max_tokens))
    console.print(f"captured {hidden.shape[0]} hidden rows of {hidden.shape[1]} from {len(PROMPTS)} prompts; "
                  f"{repeats} windows per level")
    buf = torch.empty(max(levels), head.shape[0], dtype=torch.float32)

    greedy_rows = {m: SampleBatch((0.0,) * m, (0,) * m, (1.0,) * m) for m in range(1, max(levels) + 1)}

    def logits_fn(x):
        return ops["sample"](ops["lm_head"](x, head, buf[: x.shape[0]]), greedy_rows[x.shape[0]])

    def greedy_fn(x):
        return ops["lm_head.argmax"](x, head)

    greedy_fn(hidden[:1])  # the backend's one-time copies (packing, quantising) outside the timings
    logits_fn(hidden[:1])
    rows = measure(logits_fn, greedy_fn, hidden, levels, repeats, progress=lambda s: console.print(f"  {s}"))

    table = Table(title=f"a greedy step's head, {where} (ms, median)")
    for col in ("rows", "logits + argmax", "lm_head.argmax", "speed-up", "mismatched windows"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["rows"]), f"{r['logits_ms']:.2f}", f"{r['greedy_ms']:.2f}", f"{r['ratio']:.2f}×",
                      str(r["mismatches"]))
    console.print(table)
    result = {"model": cfg.model.name, "dtype": str(cfg.model.dtype), "backend": cfg.backend.name,
              "note": ops.entry("lm_head.argmax").note, "hidden_rows": hidden.shape[0], "windows": repeats,
              "torch_threads": torch.get_num_threads(), "rows": rows}
    out = write_json(cfg, "greedy_head.json", result)
    png = os.path.splitext(out)[0] + ".png"
    _plot(rows, png, where)
    console.print(f"wrote {out} and {png}")
    if any(r["mismatches"] for r in rows):
        console.print("[red]lm_head.argmax gave other tokens than the logits' argmax[/red]")
        return 1
    return 0


def _plot(rows: Sequence[dict], path: str, where: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    xs = range(len(rows))
    ax.bar([i - 0.2 for i in xs], [r["logits_ms"] for r in rows], 0.4, label="lm_head + argmax", color="C0")
    ax.bar([i + 0.2 for i in xs], [r["greedy_ms"] for r in rows], 0.4, label="lm_head.argmax", color="C1")
    for i, r in zip(xs, rows):
        ax.annotate(f"{r['ratio']:.2f}×", (i + 0.2, r["greedy_ms"]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [f"{r['rows']} rows" for r in rows])
    ax.set_ylabel("ms per step's head (median)")
    ax.set_title(f"inferhal bench greedy_head: {where}", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
