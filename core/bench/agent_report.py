"""What ``inferhal bench agent`` reports per point (a server at one concurrency), its table and its Pareto plot.

Per point, over the turns that completed (failed turns are counted apart):

- **TTFT** (request sent → first content chunk), **TPOT** ((last chunk − first chunk) / (output tokens − 1),
  per request with two tokens or more), **ITL** (between consecutive content chunks: a chunk may carry several
  tokens where drafts were accepted, as in vLLM's bench) and **E2E** (sent → stream closed), each at p50, p90
  and p99;
- **output tok/s** (output tokens / the point's wall time) and **total tok/s** (input + output, as AgentX
  counts per device; needs the server's usage), per device: the whole host is one device here;
- **tok/s per user**: 1 / TPOT p50, the decode speed one user sees (AgentX: 1000 / TPOT ms);
- **tokens per chunk**: output tokens / content chunks, the tokens a decode step gives one request (1 without
  drafts; 1 + accepted drafts with them, where the server sends one chunk a step);
- **prefix-hit rate** and **drafts accepted**: differences of the server's ``/metrics`` counters over the point
  (``inferhal_prefix_cache_{queries,hits}_total``, ``inferhal_spec_decode_num_{draft,accepted}_tokens_total``;
  servers without them: not reported);
- **goodput**: requests per second, and their output tokens per second, of the turns that met both
  ``bench.agent.slo_ttft_ms`` and ``bench.agent.slo_tpot_ms`` (vLLM's ``--goodput``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from inferhal.core.bench.agent_client import TurnResult

QS = (50, 90, 99)
COUNTERS = {"queries": "inferhal_prefix_cache_queries_total", "hits": "inferhal_prefix_cache_hits_total",
            "drafts": "inferhal_spec_decode_num_draft_tokens_total",
            "accepted": "inferhal_spec_decode_num_accepted_tokens_total"}


def pct(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (linear between ranks); NaN for no values."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _ms(xs: Sequence[float]) -> dict[str, float]:
    return {f"p{q}": 1e3 * pct(xs, q) for q in QS}


def summarize(label: str, c: int, wall: float, results: Sequence[TurnResult], counters: Optional[dict],
              slo_ttft_ms: float, slo_tpot_ms: float) -> dict[str, Any]:
    """One point's row (see the module docstring). ``counters``: the ``/metrics`` differences over the point."""
    ok = [r for r in results if r.ok]
    ttft = [r.first - r.start for r in ok if r.first is not None]
    tpot = {id(r): (r.times[-1] - r.first) / (r.output_tokens - 1) for r in ok
            if r.first is not None and r.output_tokens > 1}
    itl = [b - a for r in ok for a, b in zip(r.times, r.times[1:])]
    e2e = [r.end - r.start for r in ok]
    out_tok = sum(r.output_tokens for r in ok)
    chunks = sum(len(r.times) for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok) if ok and all(r.prompt_tokens is not None for r in ok) else None
    good = [r for r in ok if r.first is not None and 1e3 * (r.first - r.start) <= slo_ttft_ms
            and 1e3 * tpot.get(id(r), 0.0) <= slo_tpot_ms]
    tpot_p50 = pct(list(tpot.values()), 50)
    row = {"server": label, "concurrency": c, "turns": len(results), "completed": len(ok),
           "failed": len(results) - len(ok), "errors": sorted({r.error for r in results if r.error})[:3],
           "wall_s": wall, "output_tokens": out_tok, "input_tokens": in_tok,
           "tokens_from_usage": bool(ok) and all(r.usage for r in ok),
           "ttft_ms": _ms(ttft), "tpot_ms": _ms(list(tpot.values())), "itl_ms": _ms(itl), "e2e_ms": _ms(e2e),
           "output_tok_s": out_tok / wall if wall > 0 else 0.0,
           "total_tok_s": (in_tok + out_tok) / wall if wall > 0 and in_tok is not None else None,
           "tok_s_per_user": 1.0 / tpot_p50 if tpot_p50 == tpot_p50 and tpot_p50 > 0 else None,
           "tokens_per_chunk": out_tok / chunks if chunks else None,
           "goodput_req_s": len(good) / wall if wall > 0 else 0.0,
           "goodput_tok_s": sum(r.output_tokens for r in good) / wall if wall > 0 else 0.0,
           "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms}}
    if counters:
        q, h = counters.get("queries"), counters.get("hits")
        row["prefix_hit_rate"] = h / q if q else None
        d, a = counters.get("drafts"), counters.get("accepted")
        row["drafts"], row["accepted"] = d, a
        row["acceptance"] = a / d if d else None
    return row


def _f(v: Any, fmt: str = "{:.1f}") -> str:
    return "-" if v is None or v != v else fmt.format(v)


def table(rows: Sequence[dict], title: str):
    from rich.table import Table

    t = Table(title=title)
    for col in ("server", "c", "turns ok/failed", "out tok/s", "total tok/s", "tok/s/user", "TTFT p50/p90/p99 ms",
                "TPOT p50/p90/p99 ms", "ITL p50/p99 ms", "E2E p50/p99 s", "tok/chunk", "prefix hit", "accepted",
                "goodput req/s"):
        t.add_column(col, justify="left" if col == "server" else "right")
    for r in rows:
        three = lambda d: "/".join(_f(d[f"p{q}"], "{:.0f}") for q in QS)  # noqa: E731
        t.add_row(r["server"], str(r["concurrency"]), f"{r['completed']}/{r['failed']}", _f(r["output_tok_s"]),
                  _f(r["total_tok_s"]), _f(r["tok_s_per_user"]), three(r["ttft_ms"]), three(r["tpot_ms"]),
                  f"{_f(r['itl_ms']['p50'], '{:.0f}')}/{_f(r['itl_ms']['p99'], '{:.0f}')}",
                  f"{_f(r['e2e_ms']['p50'] / 1e3, '{:.2f}')}/{_f(r['e2e_ms']['p99'] / 1e3, '{:.2f}')}",
                  _f(r["tokens_per_chunk"], "{:.2f}"), _f(r.get("prefix_hit_rate"), "{:.0%}"),
                  _f(r.get("acceptance"), "{:.0%}"), _f(r["goodput_req_s"], "{:.2f}"))
    return t


def plot(rows: Sequence[dict], path: str, title: str, stamp: str) -> None:
    """Pareto curves, one per server: total (input + output) and output tok/s per device against tok/s per
    user, each point labelled with its concurrency; ``stamp`` (commit, host, date) in the corner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    servers = list(dict.fromkeys(r["server"] for r in rows))
    for i, name in enumerate(servers):
        rs = sorted((r for r in rows if r["server"] == name and r["tok_s_per_user"]), key=lambda r: r["concurrency"])
        for ax, key in zip(axes, ("total_tok_s", "output_tok_s")):
            pts = [(r["tok_s_per_user"], r[key], r["concurrency"]) for r in rs if r[key] is not None]
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i}", label=name)
            for x, y, c in pts:
                ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=f"C{i}")
    for ax, what in zip(axes, ("input + output tok/s per device", "output tok/s per device")):
        ax.set_xlabel("tok/s per user (1 / TPOT p50)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.text(0.99, 0.01, stamp, ha="right", va="bottom", fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
