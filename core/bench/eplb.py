"""``inferhal bench eplb``: our EPLB policy vs DeepSeek's public EPLB and our greedy baseline, at V4 sizes.

Loads (61 layers x 256 experts, 8 groups): Zipf, lognormal, hot experts, hot groups. Layouts: 288/320/384
physical slots on 1/4/8 nodes and 8/32/64 GPUs. Per case and policy: balancedness (mean over layers of
max/mean per-GPU load) on the window the plan was made from and, averaged over ``DRIFTS`` drifted next
windows (the same windows for every policy, so policies are compared window by window, with the standard
error of that paired difference; one window alone is too noisy to rank policies by), the lower
bound, whether the plan is valid, and the runtime: the median of ``bench.repeats`` calls after one warm-up,
the policies interleaved call by call so that they share the host's noise; compare the ratios.

Policies, all called with the same arguments and scored by the same metric code
(:mod:`inferhal.core.eplb.metrics`):

- ``inferhal``: :func:`~inferhal.core.eplb.rebalance_experts` (plans for the next window, ``drift=0.35``).
- ``inferhal-drift0``: the same policy planning for the current window alone (``drift=0``).
- ``deepseek``: DeepSeek's public EPLB (deepseek-ai/EPLB ``eplb.py``), run from the copy that the pinned
  sglang wheel publishes (:mod:`._eplb_peer`); "not run" with the reason when the wheel cannot be had.
  ``bench.peers`` without ``deepseek`` (and not empty) skips it.
- ``greedy``: :func:`~inferhal.core.eplb.baseline.rebalance_greedy`, our vectorised LPT baseline.

A second table compares the vectorised policy with itself run one layer at a time. Writes ``eplb.json``
(or ``output=``) and ``eplb.png`` under ``bench.output_dir`` and prints the tables. Runtimes are
wall-clock on this host's CPU, every policy at one torch thread (the fastest setting for each of them on a
small shared host; DeepSeek's, mostly a Python loop, ran ~15x slower at two threads on 2 busy cores).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Callable

import torch

from inferhal.core.bench._eplb_peer import Peer, load_deepseek
from inferhal.core.bench.stamp import stamp
from inferhal.core.eplb.baseline import rebalance_greedy, rebalance_per_layer
from inferhal.core.eplb.metrics import balancedness, lower_bound
from inferhal.core.eplb.placement import build_log2phy
from inferhal.core.eplb.policy import one_thread, rebalance_experts
from inferhal.core.eplb.validate import PlacementError, validate_placement

LAYERS, EXPERTS, GROUPS = 61, 256, 8
LAYOUTS = ((288, 1, 8), (320, 4, 32), (384, 8, 64), (320, 1, 32), (384, 1, 64))  # (slots, nodes, gpus)
SPEED_LAYOUTS = ((288, 1, 8), (384, 1, 64))
KINDS = ("zipf", "lognormal", "hot_experts", "hot_groups")
DRIFTS = 64  # drifted next windows per case


def synthetic_load(kind: str, seed: int, layers: int = LAYERS, experts: int = EXPERTS,
                   groups: int = GROUPS) -> torch.Tensor:
    """``[layers, experts]`` token counts of one window (about 8k tokens x top-8 per layer)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "zipf":  # rank-frequency 1/r^1.1, a different hot set per layer
        base = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.1
        w = torch.stack([base[torch.randperm(experts, generator=g)] for _ in range(layers)])
    elif kind == "lognormal":
        w = torch.exp(1.5 * torch.randn(layers, experts, generator=g, dtype=torch.float64))
    elif kind == "hot_experts":  # uniform background, 8 experts per layer x25
        w = 0.5 + torch.rand(layers, experts, generator=g, dtype=torch.float64)
        hot = torch.rand(layers, experts, generator=g).argsort(dim=1)[:, :8]
        w.scatter_(1, hot, w.gather(1, hot) * 25)
    elif kind == "hot_groups":  # one or two groups per layer carry x6 load
        w = torch.exp(0.5 * torch.randn(layers, experts, generator=g, dtype=torch.float64))
        gs = experts // groups
        for l in range(layers):
            for grp in torch.randperm(groups, generator=g)[: 1 + l % 2].tolist():
                w[l, grp * gs:(grp + 1) * gs] *= 6
    else:
        raise ValueError(f"unknown load kind {kind!r}")
    tokens = 8192 * 8
    return torch.round(w / w.sum(dim=1, keepdim=True) * tokens).float()


def drifted(load: torch.Tensor, seed: int, sigma: float = 0.35) -> torch.Tensor:
    """The next window: each expert's load times exp(sigma * N(0, 1)), same total per layer."""
    g = torch.Generator().manual_seed(seed)
    w = load * torch.exp(sigma * torch.randn(load.shape, generator=g))
    return torch.round(w / w.sum(dim=1, keepdim=True) * load.sum(dim=1, keepdim=True))



@dataclass
class Row:
    load: str
    slots: int
    nodes: int
    gpus: int
    policy: str
    balancedness: float
    drifted: float  # mean over the drifted next windows
    lower_bound: float
    seconds: float  # median of the timed calls
    invalid: str = ""  # why the plan breaks an invariant; empty when it is valid
    drifted_windows: list = field(default_factory=list)  # balancedness on each drifted window


def policies(peer: Peer) -> dict[str, Callable]:
    """The policies one run compares: ours, the peer when it loaded, the greedy baseline."""
    out: dict[str, Callable] = {"inferhal": rebalance_experts}
    if peer.fn is not None:
        out[peer.name] = peer.fn
    out["greedy"] = rebalance_greedy
    out["inferhal-drift0"] = partial(rebalance_experts, drift=0.0)
    return out


def _invalid(phy2log: torch.Tensor, logcnt: torch.Tensor, gpus: int, nodes: int) -> str:
    """Our validator on ``phy2log``/``logcnt`` (and the node constraint); a peer orders its ``log2phy``
    its own way, so the one checked is rebuilt from ``phy2log``."""
    E = logcnt.shape[1]
    try:
        validate_placement(phy2log, build_log2phy(phy2log, E, int(logcnt.max())), logcnt, num_logical=E,
                           num_gpus=gpus, num_groups=GROUPS, num_nodes=nodes)
    except PlacementError as exc:
        return str(exc)
    return ""


def measure(kinds=KINDS, layouts=LAYOUTS, seed: int = 0, repeats: int = 3,
            pols: dict[str, Callable] | None = None, layers: int = LAYERS) -> list[Row]:
    """One row per (load, layout, policy), same load and arguments for every policy. Each policy runs
    ``1 + repeats`` times per case, interleaved call by call with the others; the first call is the
    warm-up and gives the plan, the others the median time. All run at one torch thread (ours sets it
    anyway; DeepSeek's runs ~15x slower at two threads on a busy 2-core host)."""
    pols = pols if pols is not None else policies(Peer("deepseek", reason="not run: not requested"))
    rows = []
    for ki, kind in enumerate(kinds):
        load = synthetic_load(kind, seed + ki, layers=layers)
        nxt = [drifted(load, seed + 100 + DRIFTS * ki + d) for d in range(DRIFTS)]
        for slots, nodes, gpus in layouts:
            lb = lower_bound(load, slots, GROUPS, nodes, gpus)
            plans: dict[str, tuple] = {}
            times: dict[str, list[float]] = {name: [] for name in pols}
            with one_thread():  # every policy at one torch thread: the fastest setting for each here
                for r in range(1 + repeats):
                    for name, fn in pols.items():
                        t = time.perf_counter()
                        out = fn(load, slots, GROUPS, nodes, gpus)
                        if r:
                            times[name].append(time.perf_counter() - t)
                        plans.setdefault(name, out)
            for name, (p2l, _, cnt) in plans.items():
                p2l, cnt = p2l.long(), cnt.long()
                sec = statistics.median(times[name]) if times[name] else float("nan")
                windows = [balancedness(w, p2l, cnt, gpus) for w in nxt]
                rows.append(Row(kind, slots, nodes, gpus, name, balancedness(load, p2l, cnt, gpus),
                                statistics.fmean(windows), lb, sec, _invalid(p2l, cnt, gpus, nodes), windows))
    return rows


def speed(layouts=SPEED_LAYOUTS, seed: int = 0, layers: int = LAYERS) -> list[dict]:
    out = []
    load = synthetic_load("lognormal", seed, layers=layers)
    for slots, nodes, gpus in layouts:
        rebalance_experts(load[:2], slots, GROUPS, nodes, gpus)  # warm-up
        vec = min(_timed(rebalance_experts, load, slots, GROUPS, nodes, gpus)[1] for _ in range(2))
        (a, loop_s) = _timed(rebalance_per_layer, load, slots, GROUPS, nodes, gpus)
        same = torch.equal(a[0], rebalance_experts(load, slots, GROUPS, nodes, gpus)[0])
        out.append(dict(slots=slots, nodes=nodes, gpus=gpus, vectorised_s=vec, per_layer_loop_s=loop_s,
                        ratio=loop_s / vec, identical=same))
    return out


def _timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def _cases(rows: list[Row]) -> dict[tuple, dict[str, Row]]:
    by: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        by.setdefault((r.load, r.slots, r.nodes, r.gpus), {})[r.policy] = r
    return by


def paired_drift(a: Row, b: Row) -> tuple[float, float]:
    """Mean and standard error over the drifted windows of ``a``'s balancedness minus ``b``'s (the same
    windows for both; 0 s.e. when there are fewer than two)."""
    d = [x - y for x, y in zip(a.drifted_windows, b.drifted_windows)]
    if len(d) < 2:
        return a.drifted - b.drifted, 0.0
    return statistics.fmean(d), statistics.stdev(d) / math.sqrt(len(d))


def summarize(rows: list[Row], ours: str = "inferhal", tol: float = 1e-6) -> dict:
    """Means per policy and, against each other policy, in how many cases ours is better / worse (same
    window, drifted, and drifted by more than 2 standard errors of the paired difference) and the time
    ratio ``theirs / ours`` (> 1: ours is faster) over the cases."""
    cases = list(_cases(rows).values())
    names = list(cases[0]) if cases else []
    out: dict = {"cases": len(cases)}
    for name in names:
        rs = [c[name] for c in cases]
        out[name] = dict(mean_balancedness=statistics.fmean(r.balancedness for r in rs),
                         mean_drifted=statistics.fmean(r.drifted for r in rs),
                         geomean_imbalance=math.exp(statistics.fmean(math.log(max(r.balancedness - 1, 1e-9))
                                                                     for r in rs)) + 1,
                         median_seconds=statistics.median(r.seconds for r in rs),
                         invalid_plans=sum(bool(r.invalid) for r in rs))
    out["mean_lower_bound"] = statistics.fmean(c[ours].lower_bound for c in cases) if cases else float("nan")
    for name in names:
        if name == ours:
            continue
        ratio = [c[name].seconds / c[ours].seconds for c in cases]
        paired = [paired_drift(c[ours], c[name]) for c in cases]
        out[f"{ours}_vs_{name}"] = dict(
            better=sum(c[ours].balancedness < c[name].balancedness - tol for c in cases),
            worse=sum(c[ours].balancedness > c[name].balancedness + tol for c in cases),
            drifted_better=sum(c[ours].drifted < c[name].drifted - tol for c in cases),
            drifted_worse=sum(c[ours].drifted > c[name].drifted + tol for c in cases),
            drifted_better_2se=sum(d < -2 * se for d, se in paired),
            drifted_worse_2se=sum(d > 2 * se for d, se in paired),
            drifted_mean_difference=statistics.fmean(d for d, _ in paired),
            time_ratio_min=min(ratio), time_ratio_median=statistics.median(ratio), time_ratio_max=max(ratio),
            slower_cases=sum(x < 1 for x in ratio))
    return out


def _print(rows: list[Row], speeds: list[dict], peer: Peer, repeats: int) -> None:
    from inferhal.core.console import console as make_console
    from rich.table import Table

    cases = _cases(rows)
    names = list(next(iter(cases.values()))) if cases else []
    short = {"inferhal": "ours", "deepseek": "DeepSeek", "greedy": "greedy", "inferhal-drift0": "ours drift=0"}
    t = Table(title=f"EPLB balancedness (max/mean GPU load, mean over {LAYERS} layers; 1.0 = perfect; drifted: mean "
                    f"over {DRIFTS} next windows) and runtime (median of {repeats} calls, ms)")
    t.add_column("load")
    t.add_column("slots/nodes/GPUs", justify="right")
    t.add_column("bound", justify="right")
    for suffix in ("", " drifted", " ms"):
        for n in names:
            t.add_column(short.get(n, n) + suffix, justify="right")
    others = [n for n in names if n != "inferhal"]
    for n in others:
        t.add_column(f"{short.get(n, n)}/ours time", justify="right")
    for n in others:
        t.add_column(f"ours-{short.get(n, n)} drifted (2 s.e.)", justify="right")
    for (load, slots, nodes, gpus), c in cases.items():
        cells = [load, f"{slots}/{nodes}/{gpus}", f"{c['inferhal'].lower_bound:.4f}"]
        cells += [f"{c[n].balancedness:.4f}" + (" INVALID" if c[n].invalid else "") for n in names]
        cells += [f"{c[n].drifted:.4f}" for n in names]
        cells += [f"{c[n].seconds * 1e3:.1f}" for n in names]
        cells += [f"{c[n].seconds / c['inferhal'].seconds:.2f}x" for n in others]
        for n in others:
            d, se = paired_drift(c["inferhal"], c[n])
            cells.append(f"{d:+.4f} ({2 * se:.4f})")
        t.add_row(*cells)
    console = make_console(min_width=200)
    console.print(t)
    if peer.fn is None:
        console.print(f"[yellow]DeepSeek EPLB {peer.reason}[/]")
    else:
        console.print(f"DeepSeek EPLB: {peer.source}")
    for r in rows:
        if r.invalid:
            console.print(f"[red]{r.policy} {r.load} {r.slots}/{r.nodes}/{r.gpus}: invalid plan: {r.invalid}[/]")
    s = Table(title="Our policy: vectorised over layers vs a per-layer Python loop (same plans)")
    for col in ("slots/nodes/GPUs", "vectorised s", "per-layer loop s", "ratio", "identical"):
        s.add_column(col, justify="right")
    for d in speeds:
        s.add_row(f"{d['slots']}/{d['nodes']}/{d['gpus']}", f"{d['vectorised_s']:.3f}",
                  f"{d['per_layer_loop_s']:.3f}", f"{d['ratio']:.1f}x", str(d["identical"]))
    console.print(s)


def _plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = _cases(rows)
    names = list(next(iter(cases.values())))
    labels = [f"{k[0]}\n{k[1]}/{k[2]}/{k[3]}" for k in cases]
    x = list(range(len(cases)))
    width = 0.8 / len(names)
    fig, axes = plt.subplots(3, 1, figsize=(max(10, len(cases) * 0.8), 11), sharex=True)
    ax = axes[0]
    for k, name in enumerate(names):
        ax.bar([i - 0.4 + width * (k + 0.5) for i in x], [c[name].balancedness - 1 for c in cases.values()], width,
               label=name)
    ax.scatter(x, [c["inferhal"].lower_bound - 1 for c in cases.values()], marker="_", s=200, color="k",
               label="lower bound", zorder=3)
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_ylabel("balancedness - 1")
    ax.set_title("EPLB imbalance, same window; slots/nodes/GPUs")
    ax.legend()
    # Drifted: every policy against one reference, window by window (the absolute values hide the gaps).
    ref = "deepseek" if "deepseek" in names else "greedy"
    others = [n for n in names if n != ref]
    w2 = 0.8 / max(1, len(others))
    ax = axes[1]
    for k, name in enumerate(others):
        d = [paired_drift(c[name], c[ref]) for c in cases.values()]
        ax.bar([i - 0.4 + w2 * (k + 0.5) for i in x], [m for m, _ in d], w2, yerr=[2 * se for _, se in d],
               capsize=2, label=name, color=f"C{names.index(name)}")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_ylabel(f"balancedness - {ref}'s")
    ax.set_title(f"drifted next windows: minus {ref}'s, window by window (mean of {DRIFTS}, bars 2 s.e.; "
                 f"below 0 = better)")
    ax.legend()
    ax = axes[2]
    for k, name in enumerate(names):
        ax.bar([i - 0.4 + width * (k + 0.5) for i in x], [c[name].seconds * 1e3 for c in cases.values()], width,
               label=name)
    ax.set_ylabel("ms per call (median)")
    ax.set_title("policy runtime; slots/nodes/GPUs")
    ax.legend()
    axes[-1].set_xticks(x, labels, rotation=90, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def peer_for(cfg) -> Peer:
    wanted = [str(p) for p in (getattr(getattr(cfg, "bench", None), "peers", None) or [])]
    if wanted and "deepseek" not in wanted:
        return Peer("deepseek", reason=f"not run: bench.peers={wanted} does not name deepseek")
    return load_deepseek()


def run(cfg) -> int:
    bench = getattr(cfg, "bench", None)
    out_dir = str(getattr(bench, "output_dir", None) or "bench-results")
    repeats = max(1, int(getattr(bench, "repeats", 3) or 3))
    path = str(cfg.output) if getattr(cfg, "output", None) else os.path.join(out_dir, "eplb.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # before the work, not after it
    seed = int(getattr(cfg, "seed", 0) or 0)
    t0 = time.perf_counter()
    peer = peer_for(cfg)
    print(f"bench eplb: torch threads {torch.get_num_threads()} (policies run single-threaded), "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; shared machines: compare ratios "
          f"within one run")
    rows = measure(KINDS, LAYOUTS, seed, repeats, policies(peer), LAYERS)
    speeds = speed(SPEED_LAYOUTS, seed, LAYERS)
    _print(rows, speeds, peer, repeats)
    summary = summarize(rows)
    summary.update(deepseek_source=peer.source or peer.reason, repeats=repeats,
                   min_loop_ratio=min(d["ratio"] for d in speeds), total_seconds=time.perf_counter() - t0,
                   load_average=os.getloadavg()[0], host=f"CPU, {os.cpu_count()} cores; every policy at one thread")
    with open(path, "w") as f:
        json.dump(dict(summary=summary, rows=[asdict(r) for r in rows], speed=speeds, stamp=stamp()), f, indent=1)
    png = os.path.splitext(path)[0] + ".png"
    _plot(rows, png)
    print(json.dumps(summary, indent=1))
    print(f"wrote {path} and {png}")
    return 0
