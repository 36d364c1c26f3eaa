"""The planner against what was measured or published (``inferhal plan calibrate``), side by side.

Two kinds of rows, both from ``anchors.yaml`` beside this file (data: every assumption next to its entry):

- **published**: a figure from outside (vLLM, SemiAnalysis, DeepInfer) and the planner's prediction under
  the entry's overrides; ``missing`` says which public fact the prediction had to assume. Nothing is
  tuned: a prediction far from its figure is reported as it is.
- **hosts**: decode steps this project recorded on its CPU hosts (``docs/perf/*.json`` rows, or numbers a
  document gives) against the roofline on that host's readings at the time (read bandwidth, and the product
  rate where the run measured one; without it the prediction is the bytes floor only).
"""

from __future__ import annotations

import json
import os
from importlib import resources

from inferhal.core.errors import UserError

#: a product rate standing in for one a run did not record: the prediction is then the bytes floor alone
UNRECORDED = 1e30


def anchors() -> dict:
    import yaml

    return yaml.safe_load((resources.files("inferhal.core.plan") / "anchors.yaml").read_text())


def _compose(overrides):
    from inferhal.core.config.compose import compose

    return compose(list(overrides), "plan")  # an anchor's deployment, read as `inferhal plan` reads it


def _inventory(cfg):
    from inferhal.core.plan.inventory import inventory
    from inferhal.core.plan.kv import kv_groups_for

    return inventory(cfg.model, kv_groups_for(cfg.model, str(cfg.cache.kv_dtype)))


def published(entry: dict) -> dict:
    """One published anchor: its figure and the planner's prediction (with the row it came from)."""
    from inferhal.core.plan import deploy, hardware

    cfg = _compose(entry["overrides"])
    plan = deploy.plan(cfg, hardware.resolve(str(cfg.plan.device)), _inventory(cfg))
    fitting = [r for r in plan["rows"] if r["fits"]]
    if entry["batch"] == "max_fit":
        row = fitting[-1] if fitting else None
    else:
        row = next((r for r in plan["rows"] if r["batch"] == int(entry["batch"])), None)
    metric = entry["metric"]
    value = plan.get(metric) if metric in plan else (row or {}).get(metric)
    fig = entry.get("figure")
    return {"kind": "published", "name": entry["name"], "figure": fig, "unit": entry["unit"], "predicted": value,
            "ratio": (value / fig) if (fig and value) else None, "batch": row["batch"] if row else None,
            "step_ms": row["step_ms"] if row else None, "limited_by": row["limited_by"] if row else None,
            "bound": row["bound"] if row else None, "source": entry["source"], "assumptions": entry["assumptions"],
            "missing": entry["missing"], "overrides": entry["overrides"]}


def _measured_rows(entry: dict, root: str) -> list[dict]:
    """``[{engine, concurrency, tpot_ms, read_gbs, product_gflops}]`` of a host entry."""
    if "measured" in entry:
        return [{"engine": e, "concurrency": int(m["concurrency"]), "tpot_ms": float(m["tpot_ms"]),
                 "read_gbs": None, "product_gflops": None} for m in entry["measured"] for e in entry["engines"]]
    path = os.path.join(root, entry["file"])
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    with open(path) as f:
        data = json.load(f)
    return [{"engine": r["engine"], "concurrency": int(r["concurrency"]), "tpot_ms": float(r["tpot_p50_ms"]),
             "read_gbs": r.get("read_gbs"), "product_gflops": r.get("product_gflops")}
            for r in data.get("rows", []) if r.get("engine") in entry["engines"] and r.get("tpot_p50_ms")]


def host_rows(entry: dict, root: str) -> list[dict]:
    """Each recorded decode step of a host entry against the roofline on that host's readings."""
    from inferhal.core.plan import deploy, hardware, roofline

    try:
        measured = _measured_rows(entry, root)
    except FileNotFoundError as exc:
        return [{"kind": "host", "name": entry["name"], "error": f"recorded run not found: {exc} (the recorded runs "
                                                                  f"live in a checkout's docs/: run from its root)"}]
    out = []
    for m in measured:
        dtype = entry["engines"][m["engine"]]
        read = m["read_gbs"] or entry.get("read_gbs")
        rate = m["product_gflops"] or (entry.get("product_gflops") or {}).get(dtype)
        if not read:
            out.append({"kind": "host", "name": entry["name"], "engine": m["engine"], "concurrency": m["concurrency"],
                        "measured_ms": m["tpot_ms"], "error": "no read bandwidth recorded for this run"})
            continue
        prof = hardware.recorded_host(entry["name"], float(read), {dtype: float(rate) if rate else UNRECORDED / 1e9},
                                      entry.get("read_source", f"{entry.get('file')}: read_gbs / product_gflops of the row"))
        cfg = _compose([f"model={entry['model']}", f"model.dtype={dtype}", "parallel=single"])
        s = deploy.setup(cfg, prof, _inventory(cfg), roofline.Layout())
        b, n = m["concurrency"], float(entry["context"])
        st = roofline.step(b, b, b * s.inv.kv_read(n), b * s.inv.attn_flops(n), s.main, s.layout, s.machine)
        pred = st["s"] * 1e3
        top = max(st["phases"].items(), key=lambda kv: kv[1]["s"])
        out.append({"kind": "host", "name": entry["name"], "engine": m["engine"], "dtype": dtype,
                    "concurrency": b, "measured_ms": m["tpot_ms"], "predicted_ms": pred,
                    "error": (pred - m["tpot_ms"]) / m["tpot_ms"], "read_gbs": float(read),
                    "product_gflops": float(rate) if rate else None,
                    "bytes_floor_only": not rate,
                    "bound": f"{top[0]} ({top[1]['bound']})"})
    return out


def device_rows(entry: dict, root: str) -> list[dict]:
    """Each recorded per-op row of a device run (bytes, FLOPs, ms) against ``max(bytes / bandwidth, flops / peak)``
    on the device's catalog profile: the share of the roofline the op reached."""
    from inferhal.core.plan import hardware

    path = os.path.join(root, entry["file"])
    if not os.path.isfile(path):
        return [{"kind": "device", "name": entry["name"], "error": f"recorded run not found: {path}"}]
    with open(path) as f:
        data = json.load(f)
    prof = hardware.resolve(entry["device"])
    out = []
    for r in data.get("perf", []):
        if r.get("status") != "measured" or not r.get("ms"):
            continue
        peak = float(prof.peak_flops.get(r.get("dtype"), 0.0))
        flops = float(r.get("flops") or 0)
        if flops and not peak:
            continue  # a dtype the profile has no peak for (no roofline to hold it to)
        pred = max(float(r.get("bytes") or 0) / prof.peak_bandwidth, flops / peak if flops else 0.0) * 1e3
        out.append({"kind": "device", "name": entry["name"], "op": r["name"], "measured_ms": float(r["ms"]),
                    "predicted_ms": pred, "error": (pred - float(r["ms"])) / float(r["ms"]),
                    "of_roofline": pred / float(r["ms"]),
                    "bound": "memory" if float(r.get("bytes") or 0) / prof.peak_bandwidth >= (flops / peak if flops else 0)
                    else "compute"})
    return out


MISSES = ("Host steps: the roofline predicts the products' bytes or FLOPs at the rate one large product reached; "
          "it misses per-op dispatch and Python time (hundreds of op calls a step: the whole of a tiny model's "
          "step), the norms, rope, sampling and KV writes outside the products, and products that reach less "
          "than the large-product rate at small row counts.")


def _binding(r: dict) -> str:
    """What limits a published row's step: prefill pool or decode, and the decode step's largest phase."""
    b = r.get("bound") or {}
    return f"{r.get('limited_by', '-')}; {', '.join(f'{k} {v}' for k, v in b.items())}"


def run(cfg) -> int:
    from rich.table import Table

    from inferhal.core.console import console as make_console

    root = os.getcwd()
    data = anchors()
    rows = [published(e) for e in data["published"]]
    for e in data["hosts"]:
        rows += host_rows(e, root)
    for e in data.get("devices", []):
        rows += device_rows(e, root)
    con = make_console()
    t = Table(title="published figures against the planner (stated assumptions; nothing tuned)")
    for c in ("figure", "published", "predicted", "pred/pub", "at batch", "binding", "missing assumption"):
        t.add_column(c, justify="right" if c in ("published", "predicted", "pred/pub", "at batch") else "left")
    for r in rows:
        if r["kind"] != "published":
            continue
        t.add_row(f"{r['name']} [{r['unit']}]", "-" if r["figure"] is None else f"{r['figure']:,}",
                  "-" if r["predicted"] is None else f"{r['predicted']:,.2f}",
                  "-" if r["ratio"] is None else f"{r['ratio']:.2f}x", str(r["batch"]), _binding(r), r["missing"])
    con.print(t)
    t = Table(title="recorded CPU decode steps against the roofline on the host's own readings")
    for c in ("run", "engine", "c", "read GB/s", "GFLOP/s", "measured ms", "predicted ms", "error", "bound"):
        t.add_column(c, justify="left" if c in ("run", "engine", "bound") else "right")
    for r in rows:
        if r["kind"] != "host":
            continue
        if "predicted_ms" not in r:
            t.add_row(r["name"], r.get("engine", "-"), str(r.get("concurrency", "-")), "-", "-",
                      str(r.get("measured_ms", "-")), "-", "-", r["error"])
            continue
        t.add_row(r["name"], r["engine"], str(r["concurrency"]), f"{r['read_gbs']:.1f}",
                  "not recorded" if r["bytes_floor_only"] else f"{r['product_gflops']:.0f}", f"{r['measured_ms']:.1f}",
                  f"{r['predicted_ms']:.1f}", f"{r['error']:+.0%}", r["bound"])
    con.print(t)
    t = Table(title="recorded device ops against the roofline of the device's catalog profile")
    for c in ("run", "op", "measured ms", "roofline ms", "of roofline", "bound"):
        t.add_column(c, justify="left" if c in ("run", "op", "bound") else "right")
    for r in rows:
        if r["kind"] != "device":
            continue
        if "op" not in r:
            t.add_row(r["name"], "-", "-", "-", "-", r["error"])
            continue
        t.add_row(r["name"], r["op"], f"{r['measured_ms']:.3f}", f"{r['predicted_ms']:.3f}", f"{r['of_roofline']:.0%}",
                  r["bound"])
    con.print(t)
    con.print(MISSES)
    if cfg.get("output"):
        with open(cfg.output, "w") as f:
            json.dump({"rows": rows, "misses": MISSES}, f, indent=2)
    if not rows:
        raise UserError("anchors.yaml holds no calibration entries")
    return 0
