"""``bench kv_tiers``'s summary per variant, its table and its plot (the turn records come from :mod:`.kv_tiers`).

Per variant and repeat, over its returning turns (turn 2 on): TTFT p50 and p90, the prefix-hit rate (prompt tokens
found cached / prompt tokens) and the share a tier restored, restore time per restored token, time to first token
per computed token (prompt − cached: a prefill's cost per token; the ``none`` variant's is what a lost block costs),
tokens recomputed to rebuild windows; over every turn: the first turns' TTFT p50 (a control: nothing to restore
there) and seconds in saves. TTFT is given twice: wall clock, and the process's CPU time (on a busy shared host
the wall clock also counts the time the process waited for a core). Each figure is the median over repeats; the TTFT ratio against ``none`` is the median
of the per-repeat ratios, restore against recompute the ratio of the medians.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Optional, Sequence

from inferhal.core.bench.agent_report import pct

#: the variants bench.kv_tiers.variants names (core/bench/kv_tiers.py builds each one's engine)
VARIANTS = {
    "none": "the small pool alone",
    "host": "+ a host tier",
    "disk": "+ a disk tier",
    "host_disk": "+ host and disk tiers",
    "retain": "+ window retention",
    "host_retain": "+ a host tier and window retention",
    "kept": "a pool that keeps every session",
}

KEYS = ("ttft_return_p50_ms", "ttft_return_p90_ms", "ttft_first_p50_ms", "ttft_cpu_return_p50_ms",
        "ttft_cpu_first_p50_ms", "hit_rate_return", "tier_rate_return",
        "restore_us_per_token", "prefill_ms_per_token", "replayed_tokens", "save_s", "run_s")


def _ratio(a: float, b: float) -> Optional[float]:
    return a / b if a and b else None


def one_repeat(recs: Sequence[dict[str, Any]]) -> dict[str, Optional[float]]:
    """The figures of one variant's repeat (see the module docstring)."""
    ret = [r for r in recs if r["turn"] > 1]
    first = [r for r in recs if r["turn"] == 1]
    prompt = sum(r["prompt_tokens"] for r in ret)
    tier = sum(r["tier_tokens"] for r in ret)
    per_token = [r["ttft_s"] / (r["prompt_tokens"] - r["cached_tokens"]) for r in ret
                 if r["prompt_tokens"] > r["cached_tokens"]]
    return {"ttft_return_p50_ms": 1e3 * pct([r["ttft_s"] for r in ret], 50),
            "ttft_return_p90_ms": 1e3 * pct([r["ttft_s"] for r in ret], 90),
            "ttft_first_p50_ms": 1e3 * pct([r["ttft_s"] for r in first], 50),
            "ttft_cpu_return_p50_ms": 1e3 * pct([r["ttft_cpu_s"] for r in ret], 50),
            "ttft_cpu_first_p50_ms": 1e3 * pct([r["ttft_cpu_s"] for r in first], 50),
            "hit_rate_return": _ratio(sum(r["cached_tokens"] for r in ret), prompt) or 0.0,
            "tier_rate_return": _ratio(tier, prompt) or 0.0,
            "restore_us_per_token": (1e6 * sum(r["restore_s"] for r in recs) / sum(r["tier_tokens"] for r in recs)
                                     if any(r["tier_tokens"] for r in recs) else None),
            "prefill_ms_per_token": 1e3 * statistics.median(per_token) if per_token else None,
            "replayed_tokens": sum(r["replayed_tokens"] for r in ret),
            "save_s": sum(r["save_s"] for r in recs), "run_s": sum(r["e2e_s"] for r in recs)}


def _median(xs: Sequence[Optional[float]]) -> Optional[float]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else None


def summarize(records: Sequence[dict[str, Any]], variants: Sequence[str]) -> list[dict[str, Any]]:
    """One row per variant: each figure's median over repeats, ``repeats`` (each repeat's figures), and against
    ``none``: ``ttft_speedup`` (the median over repeats of its returning-turn TTFT p50 over this variant's, in the
    same repeat) and ``restore_vs_recompute``
    (``none``'s time to first token per computed token over this variant's restore time per restored token)."""
    rows = []
    for v in variants:
        reps = sorted({r["repeat"] for r in records if r["variant"] == v})
        each = [one_repeat([r for r in records if r["variant"] == v and r["repeat"] == k]) for k in reps]
        row: dict[str, Any] = {"variant": v, **{k: _median([e[k] for e in each]) for k in KEYS}, "repeats": each}
        rows.append(row)
    base = next((r for r in rows if r["variant"] == "none"), None)
    for r in rows:  # paired per repeat: the variants of one repeat ran their turns interleaved
        for key, name in (("ttft_return_p50_ms", "ttft_speedup"), ("ttft_cpu_return_p50_ms", "ttft_cpu_speedup")):
            r[name] = _median([_ratio(b[key], e[key]) for b, e in zip(base["repeats"], r["repeats"])]) if base else None
        recompute = base["prefill_ms_per_token"] if base else None
        r["restore_vs_recompute"] = (_ratio(1e3 * recompute, r["restore_us_per_token"])
                                     if recompute and r["restore_us_per_token"] else None)
    return rows


def _f(x: Optional[float], fmt: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{fmt}}{suffix}"


def table(result: dict[str, Any], where: str) -> Any:
    from rich.table import Table


    s = result["settings"]
    t = Table(title=f"KV tiers: {s['sessions']} sessions x {s['turns']} turns on {result['pool']}, "
                    f"{where} (returning turns; medians of {s['repeats']} repeats)")
    for col in ("variant", "TTFT p50 ms", "TTFT p90 ms", "vs none", "first turn ms", "CPU TTFT p50 ms", "vs none",
                "CPU first turn ms", "hit rate", "from a tier",
                "restore us/tok", "TTFT/computed tok ms", "restore vs recompute", "replayed", "saves s",
                "tokens = none", "logprobs = kept"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    for r in result["variants"]:
        c = result["checks"].get(r["variant"], {})
        same = "-" if r["variant"] == "none" else f"{c.get('turns', 0) - len(c.get('tokens_differ', []))}/{c.get('turns', 0)}"
        kept = c.get("logprobs_equal_kept")
        t.add_row(f"{r['variant']} ({VARIANTS[r['variant']]})", _f(r["ttft_return_p50_ms"], ".1f"),
                  _f(r["ttft_return_p90_ms"], ".1f"), _f(r["ttft_speedup"], ".2f", "x"), _f(r["ttft_first_p50_ms"], ".1f"),
                  _f(r["ttft_cpu_return_p50_ms"], ".1f"), _f(r["ttft_cpu_speedup"], ".2f", "x"),
                  _f(r["ttft_cpu_first_p50_ms"], ".1f"),
                  _f(100 * r["hit_rate_return"], ".1f", "%"), _f(100 * r["tier_rate_return"], ".1f", "%"),
                  _f(r["restore_us_per_token"], ".2f"), _f(r["prefill_ms_per_token"], ".3f"),
                  _f(r["restore_vs_recompute"], ".0f", "x"), _f(r["replayed_tokens"], ".0f"), _f(r["save_s"], ".3f"),
                  same, "-" if kept is None else f"{kept}/{c.get('turns', 0)}")
    return t


def plot(result: dict[str, Any], path: str, where: str) -> None:
    """Left: each returning turn's TTFT (median over repeats) against its prompt length, per variant. Right:
    restore time per restored token against ``none``'s time to first token per computed token. The stamp's
    commit, host and date in the corner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    for i, r in enumerate(result["variants"]):
        pts: dict[tuple[int, int], list[tuple[int, float]]] = {}
        for t in result["turns"]:
            if t["variant"] == r["variant"] and t["turn"] > 1:
                pts.setdefault((t["session"], t["turn"]), []).append((t["prompt_tokens"], t["ttft_s"]))
        xs = [statistics.median(p[0] for p in v) for v in pts.values()]
        ys = [1e3 * statistics.median(p[1] for p in v) for v in pts.values()]
        a.scatter(xs, ys, s=18, color=f"C{i}", label=r["variant"], alpha=0.8)
    a.set_yscale("log")
    a.set_xlabel("prompt tokens of the returning turn")
    a.set_ylabel("TTFT ms (median over repeats)")
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
    colour = {r["variant"]: f"C{i}" for i, r in enumerate(result["variants"])}
    base = next((r for r in result["variants"] if r["variant"] == "none"), None)
    bars = ([("recompute\n(none: TTFT/computed tok)", 1e3 * base["prefill_ms_per_token"], colour["none"])]
            if base and base["prefill_ms_per_token"] else [])
    bars += [(f"restore\n({r['variant']})", r["restore_us_per_token"], colour[r["variant"]])
             for r in result["variants"] if r["restore_us_per_token"]]
    b.bar(range(len(bars)), [v for _, v, _ in bars], color=[c for _, _, c in bars])
    b.set_xticks(range(len(bars)), [n for n, _, _ in bars], fontsize=7)
    b.set_yscale("log")
    b.set_ylabel("microseconds per token")
    b.grid(axis="y", alpha=0.3)
    fig.suptitle(f"bench kv_tiers: {where}", fontsize=10)
    st = result["stamp"]
    fig.text(0.99, 0.01, f"commit {st['commit'][:12]}, {st['host']['cpu']} ({st['host']['logical_cpus']} CPUs), "
                         f"{st['date'][:16]} UTC", ha="right", va="bottom", fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
