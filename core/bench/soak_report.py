"""What ``inferhal bench soak`` prints and draws: the checks it failed, a summary table and outcomes by kind
(readable when piped), and RSS and open file descriptors of the server over the run."""

from __future__ import annotations

from typing import Any


def failed_checks(p: dict, max_growth: float) -> list[str]:
    out = []
    if p["failures"]:
        out.append(f"requests failed: {p['failures']}")
    if p["mismatches"]:
        out.append(f"{p['mismatches']} greedy outputs differ from the offline engine's (first: "
                   f"{p['mismatch_examples'][0]})")
    if p["bad_json"]:
        out.append(f"{p['bad_json']} JSON-schema outputs do not parse")
    end = p["end_state"]
    left = {k: v for k, v in end.items() if k not in ("health", "kv_cache_usage_ratio") and v != 0}
    if left or end["health"] != 200:
        out.append(f"after the load the server reports {left or ''} /health {end['health']} (want all 0 and 200)")
    for name in ("rss", "fds"):
        g = p["growth"].get(name)
        if g is not None and g > max_growth:
            out.append(f"{name} grew {100 * g:.1f} % after the warm-up (at most {100 * max_growth:.0f} %)")
    if p["server_exit"] not in (None, 0):
        out.append(f"the server exited {p['server_exit']} after SIGTERM (want 0)")
    return out


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:+.2f} %"


def report(p: dict, max_growth: float, con) -> list[str]:
    """Print the tables and the failed checks → the failed checks."""
    from rich.table import Table

    t = Table(title=f"bench soak: {p['model']} ({p['backend']}, spec={p['spec']}), {p['requests']} requests at "
                    f"concurrency {p['concurrency']} in {p['wall_s']:.0f} s (clients and server on one shared host)")
    t.add_column("measure")
    t.add_column("value", justify="right")
    outcomes = {}
    for counts in p["by_kind"].values():
        for k, v in counts.items():
            outcomes[k] = outcomes.get(k, 0) + v
    rows = [("completed", str(p["completed"])), ("hung up on purpose", str(outcomes.get("hung_up", 0))),
            ("failed", ", ".join(f"{k} {v}" for k, v in p["failures"].items()) or "0"),
            ("greedy outputs unlike offline", str(p["mismatches"])), ("JSON outputs not parsing", str(p["bad_json"])),
            ("requests/s", f"{p['requests_per_s']:.1f}"),
            ("E2E p50 / p99 s", f"{p['e2e_s']['p50']:.2f} / {p['e2e_s']['p99']:.2f}"),
            ("TTFT p50 / p99 s", f"{p['ttft_s']['p50']:.2f} / {p['ttft_s']['p99']:.2f}")]
    c = p.get("counters", {})
    q, d = c.get("prefix_cache_queries") or 0, c.get("spec_decode_num_draft_tokens") or 0
    rows += [("drafts verified / accepted", f"{d:.0f} / {c.get('spec_decode_num_accepted_tokens', 0):.0f}"),
             ("prefix-cache hit rate", f"{c.get('prefix_cache_hits', 0) / q:.0%}" if q else "-"),
             ("preemptions", f"{c.get('num_preemptions', 0):.0f}"),
             ("tokens generated", f"{c.get('generation_tokens', 0):.0f}")]
    rows += [(f"after: {k}", f"{v:g}") for k, v in p["end_state"].items()]
    g = p["growth"]
    rows += [("RSS growth after warm-up", _pct(g.get("rss"))), ("fds growth after warm-up", _pct(g.get("fds"))),
             ("samples after warm-up", str(g.get("samples_after_warmup", 0))),
             ("server exit after SIGTERM", str(p["server_exit"]))]
    if p["samples"]:
        rows.append(("RSS first / last MiB", f"{p['samples'][0][1] / 2**20:.0f} / {p['samples'][-1][1] / 2**20:.0f}"))
    for k, v in rows:
        t.add_row(k, v)
    con.print(t)
    kinds = Table(title="outcomes by kind")
    cols = sorted(outcomes)
    kinds.add_column("kind")
    for c in cols:
        kinds.add_column(c, justify="right")
    for kind, counts in p["by_kind"].items():
        kinds.add_row(kind, *(str(counts.get(c, 0)) for c in cols))
    con.print(kinds)
    failed = failed_checks(p, max_growth)
    for f in failed:
        con.print(f"FAIL {f}", highlight=False)
    return failed


def plot(p: dict, path: str) -> None:
    """RSS (MiB) and open fds of the server over the run, the warm-up shaded and the end of the plan marked; the
    stamp in the corner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s[0] for s in p["samples"]]
    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    a.plot(t, [s[1] / 2 ** 20 for s in p["samples"]], color="C0")
    b.plot(t, [s[2] for s in p["samples"]], color="C1")
    end = p["growth"].get("load_end_s") or (t[-1] if t else 0)
    for ax, label in ((a, "server RSS (MiB)"), (b, "open file descriptors")):
        ax.axvspan(0, p["settings"]["warmup"] * end, color="0.9", label="warm-up")
        ax.axvline(end, color="0.5", linestyle="--", linewidth=0.8, label="plan ran out: clients leave")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    b.set_xlabel("seconds into the load")
    a.legend(loc="lower right", fontsize=8)
    g = p["growth"]
    fig.suptitle(f"bench soak: {p['model']}, {p['requests']} requests at c={p['concurrency']}: RSS {_pct(g.get('rss'))},"
                 f" fds {_pct(g.get('fds'))} after the warm-up", fontsize=10)
    fig.text(0.99, 0.01, p["stamp"], ha="right", va="bottom", fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
