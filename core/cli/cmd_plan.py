"""``inferhal plan``: a deployment's memory, step times, throughput and cost (:mod:`inferhal.core.plan`).

- ``inferhal plan model=M plan.device=D [parallel=L] [plan.traffic.*=...]``: memory per device, the largest
  batch and context that fit, roofline step times and tok/s per user and per device over
  ``plan.traffic.batch_sizes`` (Pareto front marked), $/Mtok and revenue per device-hour; ``output=x.json``
  writes the plan, ``plan.plot=x.png`` its curve; ``-m parallel=dep8,dep16`` sweeps (Hydra multirun).
- ``inferhal plan devices``: every device the backends' ``device_catalog`` extras describe, with sources.
- ``inferhal plan calibrate``: the planner against published figures and recorded host runs
  (:mod:`inferhal.core.plan.calibrate`).
- ``inferhal plan kv model=...``: KV bytes per token per layer group and in total, and what a budget holds.
  The groups come from the model family's ``kv_groups_from_config(model_cfg)``, so no weights are loaded.
  Prints, per group, the bytes one token of context costs in one layer and in all the group's layers
  (compressed groups amortised over their ratio), then the shared-pool layout
  (:mod:`inferhal.core.paging.planning`): page size, bytes per block, and how many blocks and tokens
  ``cache.kv_cache_bytes`` (if set) holds. ``output=x.json`` writes it.
"""

from __future__ import annotations

import json

from inferhal.core.errors import UserError
from inferhal.core.plan.kv import kv_groups_for, plan_kv

SUBCOMMANDS = ("", "kv", "devices", "calibrate")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{n:,.1f} B"
        n /= 1024
    return str(n)


def run(cfg, words) -> int:
    if words == ["kv"]:
        return run_kv(cfg)
    if words == ["devices"]:
        return run_devices(cfg)
    if words == ["calibrate"]:
        from inferhal.core.plan import calibrate

        return calibrate.run(cfg)
    if words:
        raise UserError(f"usage: inferhal plan [kv|devices|calibrate] model=NAME plan.device=NAME [parallel=...] "
                        f"[plan.traffic....]; got {' '.join(words)!r}")
    return run_deployment(cfg)


def deployment(cfg) -> dict:
    """The whole plan of ``cfg`` (model x plan.device x parallel x plan.traffic) as data."""
    from inferhal.core.plan import deploy, hardware
    from inferhal.core.plan.inventory import inventory

    prof = hardware.resolve(str(cfg.plan.device))
    inv = inventory(cfg.model, kv_groups_for(cfg.model, str(cfg.cache.kv_dtype)))
    return deploy.plan(cfg, prof, inv)


def run_deployment(cfg) -> int:
    from inferhal.core.console import console as make_console
    from inferhal.core.plan import report

    plan = deployment(cfg)
    report.print_plan(plan, make_console())
    if cfg.plan.plot:
        report.plot(plan, str(cfg.plan.plot))
    if cfg.get("output"):
        with open(cfg.output, "w") as f:
            json.dump(plan, f, indent=2)
    return 0


def run_devices(cfg) -> int:
    """Every device ``plan.device`` may name, with its numbers and their sources."""
    from rich.table import Table

    from inferhal.core.console import console as make_console
    from inferhal.core.plan import hardware

    t = Table(title="devices for plan.device (from the backends' device_catalog; host = this CPU, measured)")
    for c in ("name", "backend", "memory GB", "HBM TB/s", "peak TFLOP/s", "links", "sources"):
        t.add_column(c, justify="right" if c in ("memory GB", "HBM TB/s") else "left")
    rows = {}
    for name, p in sorted(hardware.catalog().items()):
        up, out = hardware.links(p)
        links = "; ".join(f"{ln.name} {ln.bandwidth / 1e9:,.0f} GB/s x{ln.domain}" for ln in (up, out) if ln)
        flops = ", ".join(f"{k} {v / 1e12:,.0f}" for k, v in p.peak_flops.items() if v)
        t.add_row(name, p.backend, f"{p.memory_bytes / 1e9:,.0f}", f"{p.peak_bandwidth / 1e12:.2f}", flops, links,
                  " | ".join(f"{k}: {v}" for k, v in p.sources.items()))
        rows[name] = {"backend": p.backend, "memory_bytes": p.memory_bytes, "bandwidth": p.peak_bandwidth,
                      "peak_flops": dict(p.peak_flops), "links": dict(p.extra.get("links", {})), "sources": dict(p.sources)}
    t.add_row(hardware.HOST, "reference", "-", "-", "-", "-", "measured when planned (core/bench/host.py)")
    make_console().print(t)
    if cfg.get("output"):
        with open(cfg.output, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def run_kv(cfg) -> int:
    plan = plan_kv(cfg.model, int(cfg.cache.block_size), int(cfg.cache.kv_cache_bytes),
                   int(cfg.scheduler.max_num_seqs), int(cfg.scheduler.max_num_batched_tokens), str(cfg.cache.kv_dtype))
    from inferhal.core.console import console as make_console
    from rich.table import Table

    t = Table(title=f"KV cache plan: {plan['model']} (kv_dtype {plan['kv_dtype']}, block_size {plan['block_size']}, "
                    f"one pool per group)")
    cols = ("group", "kind", "layers", "tokens/slot", "window", "slot B", "B/token/layer", "B/token (group)",
            "block B", f"blocks @{plan['max_model_len']}", f"stored @{plan['max_model_len']}", "planned")
    for col in cols:
        t.add_column(col, justify="left" if col in ("group", "kind") else "right")
    for r in plan["groups"]:
        t.add_row(r["group"], r["kind"], str(r["layers"]), str(r["tokens_per_slot"]), str(r["window"] or "-"),
                  str(r["slot_bytes"]), f"{r['bytes_per_token_per_layer']:,.1f}", f"{r['bytes_per_token']:,.1f}",
                  _human(r["block_bytes"]), str(r["blocks_per_max_len_request"]),
                  _human(r["stored_bytes_per_max_len_request"]), _human(r["planned_bytes_per_max_len_request"]))
    t.add_row("total", "", "", "", "", "", "", f"{plan['bytes_per_token']:,.1f}", "", "",
              _human(plan["stored_bytes_per_max_len_request"]), _human(plan["bytes_per_max_len_request"]), style="bold")
    con = make_console()
    con.print(t)
    bs = plan["block_size"]
    note = "" if bs == plan["requested_block_size"] else f" (raised from {plan['requested_block_size']} to fit every ratio)"
    con.print(f"global KV (grows with context; window and compressor state excluded): "
              f"{plan['bytes_per_token_full_context']:,.1f} B per token")
    con.print(f"window and compressor state (sliding groups): {_human(plan['sliding_bytes_per_request'])} per request, "
              f"whatever its length; block_size {bs}{note}")
    for r in plan["groups"]:
        if r["record"]:
            con.print(f"  {r['group']}: {r['slot_bytes']} B records ({r['record']})")
    con.print(f"one request of max_model_len={plan['max_model_len']}: stores {_human(plan['stored_bytes_per_max_len_request'])}, "
              f"its blocks take {_human(plan['bytes_per_max_len_request'])} ({plan['planned_over_stored']:.3f}x)")
    if "num_blocks" in plan:
        blocks = ", ".join(f"{g} {n}" for g, n in plan["num_blocks"].items())
        con.print(f"budget {_human(plan['budget_bytes'])} (max_num_seqs {plan['max_num_seqs']}): blocks {blocks}; "
                  f"{_human(plan['allocated_bytes'])} allocated; {plan['max_len_requests']} requests of max_model_len at once")
    if cfg.get("output"):
        with open(cfg.output, "w") as f:
            json.dump(plan, f, indent=2)
    return 0
