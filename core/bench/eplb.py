"""``inferhal bench eplb``: our EPLB policy vs the greedy baseline on synthetic skewed loads at V4 sizes.

Loads (61 layers x 256 experts, 8 groups): Zipf, lognormal, hot experts, hot groups. Layouts: 288/320/384
physical slots on 1/4/8 nodes and 8/32/64 GPUs. For each case: balancedness (mean over layers of max/mean
per-GPU load) on the window the plan was made from and on a drifted next window, the lower bound, and
the policy's runtime. The speed ratio compares the vectorised policy with the same policy run one
layer at a time in a Python loop. Writes ``eplb.json`` and ``eplb.png`` under ``bench.output_dir`` and
prints a table. Runtimes are wall-clock on this host's CPU, single-threaded (the policy sets it).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass

import torch

from inferhal.core.eplb.baseline import rebalance_greedy, rebalance_per_layer
from inferhal.core.eplb.metrics import balancedness, lower_bound
from inferhal.core.eplb.policy import rebalance_experts

LAYERS, EXPERTS, GROUPS = 61, 256, 8
LAYOUTS = ((288, 1, 8), (320, 4, 32), (384, 8, 64), (320, 1, 32), (384, 1, 64))  # (slots, nodes, gpus)
SPEED_LAYOUTS = ((288, 1, 8), (384, 1, 64))


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
    drifted: float
    lower_bound: float
    seconds: float


def _timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def measure(kinds=("zipf", "lognormal", "hot_experts", "hot_groups"), layouts=LAYOUTS, seed: int = 0) -> list[Row]:
    rows = []
    for ki, kind in enumerate(kinds):
        load = synthetic_load(kind, seed + ki)
        nxt = drifted(load, seed + 100 + ki)
        for slots, nodes, gpus in layouts:
            lb = lower_bound(load, slots, GROUPS, nodes, gpus)
            for name, fn in (("inferhal", rebalance_experts), ("greedy", rebalance_greedy)):
                (p2l, _, cnt), sec = _timed(fn, load, slots, GROUPS, nodes, gpus)
                rows.append(Row(kind, slots, nodes, gpus, name, balancedness(load, p2l, cnt, gpus),
                                balancedness(nxt, p2l, cnt, gpus), lb, sec))
    return rows


def speed(layouts=SPEED_LAYOUTS, seed: int = 0) -> list[dict]:
    out = []
    load = synthetic_load("lognormal", seed)
    for slots, nodes, gpus in layouts:
        rebalance_experts(load[:2], slots, GROUPS, nodes, gpus)  # warm-up
        vec = min(_timed(rebalance_experts, load, slots, GROUPS, nodes, gpus)[1] for _ in range(2))
        (a, loop_s) = _timed(rebalance_per_layer, load, slots, GROUPS, nodes, gpus)
        same = torch.equal(a[0], rebalance_experts(load, slots, GROUPS, nodes, gpus)[0])
        greedy = _timed(rebalance_greedy, load, slots, GROUPS, nodes, gpus)[1]
        out.append(dict(slots=slots, nodes=nodes, gpus=gpus, vectorised_s=vec, per_layer_loop_s=loop_s,
                        ratio=loop_s / vec, greedy_s=greedy, identical=same))
    return out


def _print(rows: list[Row], speeds: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"EPLB balancedness (max/mean GPU load, mean over {LAYERS} layers; 1.0 = perfect)")
    for col in ("load", "slots/nodes/GPUs", "ours", "greedy", "lower bound", "ours drifted",
                "greedy drifted", "ours s", "greedy s"):
        t.add_column(col, justify="right")
    by = {(r.load, r.slots, r.nodes, r.gpus, r.policy): r for r in rows}
    for r in rows:
        if r.policy != "inferhal":
            continue
        g = by[(r.load, r.slots, r.nodes, r.gpus, "greedy")]
        t.add_row(r.load, f"{r.slots}/{r.nodes}/{r.gpus}", f"{r.balancedness:.4f}", f"{g.balancedness:.4f}",
                  f"{r.lower_bound:.4f}", f"{r.drifted:.4f}", f"{g.drifted:.4f}", f"{r.seconds:.3f}",
                  f"{g.seconds:.3f}")
    s = Table(title="Policy runtime: vectorised over layers vs a per-layer Python loop (same plans)")
    for col in ("slots/nodes/GPUs", "vectorised s", "per-layer loop s", "ratio", "greedy s", "identical"):
        s.add_column(col, justify="right")
    for d in speeds:
        s.add_row(f"{d['slots']}/{d['nodes']}/{d['gpus']}", f"{d['vectorised_s']:.3f}",
                  f"{d['per_layer_loop_s']:.3f}", f"{d['ratio']:.1f}x", f"{d['greedy_s']:.3f}", str(d["identical"]))
    console = Console(width=max(Console().width, 140))
    console.print(t)
    console.print(s)


def _plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = [r for r in rows if r.policy == "inferhal"]
    greedy = {(r.load, r.slots, r.nodes, r.gpus): r for r in rows if r.policy == "greedy"}
    labels = [f"{r.load}\n{r.slots}/{r.nodes}/{r.gpus}" for r in ours]
    x = list(range(len(ours)))
    fig, axes = plt.subplots(2, 1, figsize=(max(10, len(ours) * 0.7), 8), sharex=True)
    for ax, field, title in ((axes[0], "balancedness", "same window"), (axes[1], "drifted", "drifted next window")):
        gv = [getattr(greedy[(r.load, r.slots, r.nodes, r.gpus)], field) - 1 for r in ours]
        ov = [getattr(r, field) - 1 for r in ours]
        ax.bar([i - 0.2 for i in x], gv, 0.4, label="greedy baseline")
        ax.bar([i + 0.2 for i in x], ov, 0.4, label="inferhal")
        ax.scatter(x, [r.lower_bound - 1 for r in ours], marker="_", s=200, color="k", label="lower bound", zorder=3)
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_ylabel("balancedness - 1")
        ax.set_title(f"EPLB imbalance ({title}); slots/nodes/GPUs")
        ax.legend()
    axes[1].set_xticks(x, labels, rotation=90, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(cfg) -> int:
    out_dir = str(getattr(getattr(cfg, "bench", None), "output_dir", None) or "bench-results")
    os.makedirs(out_dir, exist_ok=True)
    seed = int(getattr(cfg, "seed", 0) or 0)
    t0 = time.perf_counter()
    rows = measure(seed=seed)
    speeds = speed(seed=seed)
    _print(rows, speeds)
    ours = [r for r in rows if r.policy == "inferhal"]
    greedy = [r for r in rows if r.policy == "greedy"]

    def gmean(v):
        return math.exp(sum(math.log(max(x - 1, 1e-9)) for x in v) / len(v)) + 1

    summary = dict(
        mean_balancedness_ours=sum(r.balancedness for r in ours) / len(ours),
        mean_balancedness_greedy=sum(r.balancedness for r in greedy) / len(greedy),
        mean_lower_bound=sum(r.lower_bound for r in ours) / len(ours),
        mean_drifted_ours=sum(r.drifted for r in ours) / len(ours),
        mean_drifted_greedy=sum(r.drifted for r in greedy) / len(greedy),
        geomean_imbalance_ours=gmean([r.balancedness for r in ours]),
        geomean_imbalance_greedy=gmean([r.balancedness for r in greedy]),
        cases_ours_better=sum(o.balancedness < g.balancedness - 1e-6 for o, g in zip(ours, greedy)),
        cases_ours_worse=sum(o.balancedness > g.balancedness + 1e-6 for o, g in zip(ours, greedy)),
        min_speed_ratio=min(d["ratio"] for d in speeds),
        total_seconds=time.perf_counter() - t0,
        host="CPU (this machine), single-threaded policy",
    )
    path = os.path.join(out_dir, "eplb.json")
    with open(cfg.output if getattr(cfg, "output", None) else path, "w") as f:
        json.dump(dict(summary=summary, rows=[asdict(r) for r in rows], speed=speeds), f, indent=1)
    png = os.path.join(out_dir, "eplb.png")
    _plot(rows, png)
    print(json.dumps(summary, indent=1))
    print(f"wrote {path} and {png}")
    return 0
