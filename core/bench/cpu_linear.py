"""``inferhal bench cpu_linear``: the products of the backends that run on this CPU against the reference's, at
Gemma 3 270M's shapes.

Each product ``x [rows, K] . w [N, K]^T`` in bf16 runs through the ``linear`` op of:

- **reference**: the reference backend (oneDNN's bf16 GEMM on a packed copy of the weight: what
  ``backend=reference`` and transformers run), the baseline every ratio is to;
- every other installed backend that is available here, runs on this CPU (its profile's torch device is
  ``cpu``) and implements ``linear`` itself (today cpu_amx and cpu_avx512, where this CPU runs them); with
  ``backend=NAME`` only that one. A backend that is unavailable is listed as not measured, with its reason.

Shapes (:data:`SHAPES`): the fused q|k|v, o, fused gate|up and down products of a layer, and the tied LM
head; rows: each ``bench.concurrency`` level (default 1, 8, 32: the decode batch). Each repeat times every
engine on every case back to back, engines in rotated order, over enough calls to fill
:data:`CALL_SECONDS`; a case's time is the median over ``bench.repeats`` of a call's mean time, and its
ratio is the median of the per-repeat ratios to the reference, so a slow spell of a shared machine falls on
both. Every engine's output is compared with the reference's (``max|diff|``, in bf16 ulps of the result's scale).

Reported: a table, ``<bench.output_dir>/cpu_linear.json`` (or ``output=``) and ``cpu_linear.png``
(speed-up over the reference per shape and row count). Wall-clock times on this CPU: a CPU result.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Sequence

import torch

from inferhal.core.bench import write_json

#: (name, N, K) of Gemma 3 270M's bf16 products
SHAPES = (("q|k|v", 1536, 640), ("o", 640, 1024), ("gate|up", 4096, 640), ("down", 640, 2048),
          ("lm_head", 262144, 640))
#: seconds of calls each timing covers (at least one call)
CALL_SECONDS = 0.05


def kernels(only: str | None = None) -> tuple[dict[str, Callable], dict[str, str]]:
    """The engines that run here (backend name -> (x, w) -> y, the reference first) and why the others do not;
    ``only``: that backend alone beside the reference."""
    from inferhal.core.config.schema import BackendConfig
    from inferhal.core.registry import BackendRegistry

    reg = BackendRegistry.discover()
    runners: dict[str, Callable] = {"reference": reg.select(BackendConfig(name="reference")).ops["linear"]}
    missing: dict[str, str] = {}
    for name in reg.names():
        if name == "reference" or (only and name != only):
            continue
        probe = reg.probe(name)
        if not probe.available:
            missing[name] = probe.reason
            continue
        active = reg.select(BackendConfig(name=name))
        if str(active.profile.torch_device) != "cpu":
            missing[name] = f"runs on {active.profile.torch_device}, not this CPU"
        elif not active.ops.entry("linear").native:
            missing[name] = "its linear is the reference's"
        else:
            runners[name] = active.ops["linear"]
    return runners, missing


def _time(fn: Callable[[], object], calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def measure(runners: dict[str, Callable], shapes: Sequence[tuple[str, int, int]], rows: Sequence[int],
            repeats: int, call_seconds: float = CALL_SECONDS, progress: Callable[[str], None] = lambda s: None) -> list[dict]:
    """One row per (shape, rows, engine): ``ms`` (median call), ``gflops``, ``ratio`` (median per-repeat
    speed-up over the first engine, the reference), ``max_ulps`` (largest difference from its output)."""
    g = torch.Generator().manual_seed(0)
    names = list(runners)
    out = []
    for shape, n, k in shapes:
        w = (torch.randn(n, k, generator=g) * k ** -0.5).bfloat16()
        for m in rows:
            x = torch.randn(m, k, generator=g).bfloat16()
            base = runners[names[0]](x, w)  # also packs and warms every engine's copy
            scale = base.float().abs().max().item() or 1.0
            calls, ulps = {}, {}
            for e in names:
                y = runners[e](x, w)
                ulps[e] = (y.float() - base.float()).abs().max().item() / (scale * 2 ** -8)
                once = _time(lambda: runners[e](x, w), 1)
                calls[e] = max(1, int(call_seconds / max(once, 1e-6)))
            times: dict[str, list[float]] = {e: [] for e in names}
            for r in range(repeats):
                for e in names[r % len(names):] + names[: r % len(names)]:
                    times[e].append(_time(lambda: runners[e](x, w), calls[e]))
            for e in names:
                ms = statistics.median(times[e]) * 1e3
                ratio = statistics.median(b / t for b, t in zip(times[names[0]], times[e]))
                out.append({"shape": shape, "n": n, "k": k, "rows": m, "engine": e, "ms": ms,
                            "gflops": 2 * m * n * k / (ms * 1e-3) / 1e9, "ratio": ratio, "max_ulps": ulps[e],
                            "calls": calls[e], "repeat_ms": [t * 1e3 for t in times[e]]})
            progress(f"{shape} {n}x{k}, {m} rows: " + ", ".join(
                f"{e} {statistics.median(times[e]) * 1e3:.3f} ms" for e in names))
    return out


def run(cfg) -> int:
    from inferhal.core.console import console as make_console
    from rich.table import Table

    from inferhal.core.bench import host
    from inferhal.core.qualify.manifest import cpu_info

    console = make_console(min_width=110)
    cpu = cpu_info()["model"]
    b = cfg.bench
    rows_levels = [int(c) for c in b.concurrency]
    only = str(cfg.backend.name) if "backend" in cfg and str(cfg.backend.name) != "reference" else None
    runners, missing = kernels(only)
    for name, why in missing.items():
        console.print(f"[yellow]{name}: not measured: {why}[/yellow]")
    console.print(f"cpu_linear on {cpu}, {torch.get_num_threads()} torch threads: "
                  f"{', '.join(runners)} x {len(SHAPES)} shapes x rows {rows_levels}, {int(b.repeats)} repeats")
    cpu0 = host.cpu_times()
    rows = measure(runners, SHAPES, rows_levels, int(b.repeats), progress=lambda s: console.print(f"  {s}"))
    steal = host.steal_share(cpu0, host.cpu_times())

    table = Table(title=f"bf16 products on {cpu} (ms per call, median; × = speed-up over the reference)")
    for col in ("shape", "rows", *(f"{e} ms" for e in runners), *(f"{e} ×" for e in list(runners)[1:]),
                *(f"{e} GFLOP/s" for e in runners)):
        table.add_column(col, justify="right")
    for shape, n, k in SHAPES:
        for m in rows_levels:
            rs = {r["engine"]: r for r in rows if r["shape"] == shape and r["rows"] == m}
            table.add_row(f"{shape} {n}x{k}", str(m), *(f"{rs[e]['ms']:.3f}" for e in runners),
                          *(f"{rs[e]['ratio']:.2f}" for e in list(runners)[1:]),
                          *(f"{rs[e]['gflops']:.0f}" for e in runners))
    console.print(table)
    worst = max((r["max_ulps"] for r in rows), default=0.0)
    stolen = "not readable" if steal is None else f"{steal * 100:.1f} % of CPU time"
    console.print(f"largest difference from the reference's output: {worst:.2f} bf16 ulps of the result's scale; "
                  f"hypervisor steal during the run: {stolen}")

    result = {"cpu": cpu, "torch_threads": torch.get_num_threads(), "repeats": int(b.repeats),
              "not_measured": missing, "steal_share": steal, "rows": rows,
              "note": "wall-clock on this CPU (a CPU result); ratio = median per-repeat speed-up over the reference"}
    out = write_json(cfg, "cpu_linear.json", result)
    png = os.path.splitext(out)[0] + ".png"
    _plot(rows, png, cpu)
    console.print(f"wrote {out} and {png}")
    return 0


def _plot(rows: Sequence[dict], path: str, cpu: str) -> None:
    """Speed-up over the reference: one panel per backend, bars per shape grouped by row count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = rows[0]["engine"] if rows else ""
    engines = [e for e in dict.fromkeys(r["engine"] for r in rows) if e != first]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    levels = sorted({r["rows"] for r in rows})
    fig, axes = plt.subplots(1, max(1, len(engines)), figsize=(6.5 * max(1, len(engines)), 4.2), squeeze=False)
    width = 0.8 / max(1, len(levels))
    for ax, eng in zip(axes[0], engines):
        for i, m in enumerate(levels):
            vals = [next(r["ratio"] for r in rows if r["engine"] == eng and r["shape"] == s and r["rows"] == m)
                    for s in shapes]
            ax.bar([j + (i - (len(levels) - 1) / 2) * width for j in range(len(shapes))], vals, width,
                   label=f"{m} rows", color=f"C{i}")
        ax.axhline(1.0, color="k", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(shapes)), shapes)
        ax.set_ylabel(f"speed-up over {first} bf16")
        ax.set_title(f"{eng} linear")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"inferhal bench cpu_linear: {cpu}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
