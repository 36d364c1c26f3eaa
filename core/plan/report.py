"""A plan as a table (rich, readable when piped: core/console.py), and its Pareto plot (matplotlib)."""

from __future__ import annotations

from inferhal.core.errors import UserError


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def print_plan(plan: dict, con) -> None:
    from rich.table import Table

    lay, tr, mem = plan["layout"], plan["traffic"], plan["memory"]
    pd = f" + {lay['prefill_devices']} prefill devices" if lay["prefill_devices"] else ""
    con.print(f"plan: {plan['model']} on {plan['device']}, tp={lay['tp']} dp={lay['dp']} ep={lay['ep']} "
              f"({lay['decode_devices']} devices{pd}); weights {plan['formats']}, KV {plan['kv_dtype']}")
    r = plan["rates"]
    links = "; ".join(f"{k} {v['name']} {v['bandwidth'] / 1e9:,.0f} GB/s x{v['domain']}"
                      for k, v in plan["links"].items() if v) or "none"
    con.print(f"rates: {r['bandwidth'] / 1e9:,.1f} GB/s, products {r['products'] / 1e12:,.4g} TFLOP/s, "
              f"attention {r['attention'] / 1e12:,.4g} TFLOP/s; links: {links}")
    t = Table(title="memory per device")
    for c in ("part", "bytes"):
        t.add_column(c, justify="left" if c == "part" else "right")
    for k, v in mem["weights"].items():
        if v:
            t.add_row(f"weights: {k}", _gb(v))
    t.add_row("activations (estimate)", _gb(mem["activations_bytes"]))
    t.add_row("reserved", _gb(mem["reserved_bytes"]))
    t.add_row("left for KV", _gb(mem["kv_free_bytes"]), style="bold")
    t.add_row("usable of device", f"{_gb(mem['usable_bytes'])} of {_gb(mem['device_bytes'])}")
    con.print(t)
    con.print(f"traffic: prompt {tr['prompt_mean']:,.0f} (mean), output {tr['output_mean']:,.0f}, prefix hits "
              f"{tr['prefix_hit_rate']:.0%}, MTP k={tr['draft_tokens']} at acceptance {tr['acceptance']:.2f}; KV per request "
              f"of {tr['context_fit']:,} tokens: {plan['kv_bytes_per_request_fit'] / 2**20:,.1f} MiB; "
              f"largest batch per attention rank that fits: {plan['max_batch']:,}")
    t = Table(title="decode batches (per attention rank); * = on the Pareto front")
    cols = ["batch", "fits", "step ms", "tok/step", "TPOT ms", "tok/s/user", "out tok/s/dev", "in+out tok/s/dev",
            "TTFT ms", "max ctx", "bound (step)"]
    money = [c for c in ("usd_per_mtok", "revenue_per_device_hour") if any(c in r for r in plan["rows"])]
    names = {"usd_per_mtok": "$/Mtok out", "revenue_per_device_hour": "$/dev-h revenue"}
    cols += [names[m] for m in money]
    for c in cols:
        t.add_column(c, justify="left" if c.startswith("bound") else "right")
    for r in plan["rows"]:
        biggest = max(r["phases_ms"], key=r["phases_ms"].get)
        cells = [f"{r['batch']}{'*' if r['batch'] in plan['pareto'] else ''}", "yes" if r["fits"] else "no",
                 f"{r['step_ms']:.3f}", f"{r['tokens_per_step']:.2f}", f"{r['tpot_ms']:.3f}", f"{r['tok_s_user']:,.1f}",
                 f"{r['tok_s_device']:,.1f}", f"{r['total_tok_s_device']:,.0f}", f"{r['ttft_ms']:,.1f}",
                 f"{plan['max_context'][str(r['batch'])]:,}", f"{biggest} ({r['bound'].get(biggest, '-')})"]
        cells += [f"{r[m]:,.3f}" for m in money]
        t.add_row(*cells)
    con.print(t)
    if "arrival" in plan:
        a = plan["arrival"]
        con.print(f"arrival rate {a['rate']:g} req/s needs {a['output_tok_s_device_needed']:,.1f} output tok/s per device: "
                  + (f"batch {a['batch']} serves it at {a['tok_s_user']:,.1f} tok/s per user" if a["batch"] else
                     "no batch that fits serves it: add devices"))
    for note in plan["notes"]:
        con.print(f"note: {note}")
    con.print("left out of every step time: " + "; ".join(plan["omitted"]))


def plot(plan: dict, path: str) -> None:
    """tok/s per device against tok/s per user, one point per fitting batch, the front joined."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise UserError(f"plan.plot needs matplotlib (pip install 'inferhal[test]'): {exc}") from None
    rows = [r for r in plan["rows"] if r["fits"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.scatter([r["tok_s_user"] for r in rows], [r["tok_s_device"] for r in rows], s=14)
    front = sorted((r for r in rows if r["batch"] in plan["pareto"]), key=lambda r: r["tok_s_user"])
    ax.plot([r["tok_s_user"] for r in front], [r["tok_s_device"] for r in front], lw=1)
    for r in rows:
        ax.annotate(str(r["batch"]), (r["tok_s_user"], r["tok_s_device"]), fontsize=7)
    lay = plan["layout"]
    ax.set_xlabel("output tok/s per user")
    ax.set_ylabel("output tok/s per device")
    ax.set_title(f"{plan['model']} on {plan['device']} (tp{lay['tp']} dp{lay['dp']} ep{lay['ep']}"
                 f"{' +' + str(lay['prefill_devices']) + ' prefill' if lay['prefill_devices'] else ''}): roofline", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
