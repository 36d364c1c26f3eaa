"""``inferhal plan kv model=...``: KV bytes per token per layer group and in total, and what a budget holds.

The groups come from the model family's ``kv_groups_from_config(model_cfg)`` (in
``inferhal.core.models.<family>``), so no weights are loaded. Prints, per group, the bytes one token of
context costs in one layer and in all the group's layers (compressed groups amortised over their
ratio), then the shared-pool layout (:mod:`inferhal.core.paging.planning`): page size, bytes per block,
and how many blocks and tokens ``cache.kv_cache_bytes`` (if set) holds. ``output=x.json`` writes it.
"""

from __future__ import annotations

import importlib
import json

from inferhal.core.errors import UserError
from inferhal.core.paging import planning
from inferhal.core.paging.kv_manager import KVCacheManager

SUBCOMMANDS = ("kv",)


def kv_groups_for(model_cfg):
    try:
        mod = importlib.import_module(f"inferhal.core.models.{model_cfg.family}")
    except ImportError as exc:
        raise UserError(f"model family {model_cfg.family!r} cannot be imported: {exc}") from None
    fn = getattr(mod, "kv_groups_from_config", None)
    if fn is None:
        raise UserError(f"model family {model_cfg.family!r} offers no kv_groups_from_config(model_cfg), so its KV "
                        f"cannot be planned without loading the model")
    return list(fn(model_cfg))


def plan_kv(model_cfg, block_size: int, budget_bytes: int = 0) -> dict:
    specs = kv_groups_for(model_cfg)
    bs = planning.compatible_block_size(specs, block_size)
    groups = planning.layouts(specs, bs)
    rows = []
    for s, g in zip(specs, groups):
        rows.append({"group": s.name, "kind": s.kind, "layers": len(s.layers), "tokens_per_slot": s.tokens_per_slot,
                     "window": s.window, "slot_bytes": s.slot_bytes(),
                     "bytes_per_token_per_layer": s.slot_bytes() / s.tokens_per_slot,
                     "bytes_per_token": s.bytes_per_token(), "page_bytes": g.slots_per_block * g.slot_bytes})
    per_block = planning.bytes_per_block(groups)
    max_len = int(model_cfg.max_model_len)
    kv = KVCacheManager(specs, bs, 1, enable_caching=False)
    req_blocks = kv.blocks_for(max_len) - sum(  # sliding groups keep only their window
        max(0, -(-max_len // bs) - (-(-(s.window + bs) // bs))) for s in specs if s.kind == "sliding")
    out = {"model": str(model_cfg.name), "block_size": bs, "requested_block_size": block_size, "groups": rows,
           "bytes_per_token": sum(r["bytes_per_token"] for r in rows),
           "bytes_per_token_full_context": sum(r["bytes_per_token"] for r in rows if r["kind"] != "sliding"),
           "sliding_bytes_per_request": sum(r["bytes_per_token"] * r["window"] for r in rows if r["kind"] == "sliding"),
           "page_bytes": planning.page_bytes(groups), "layer_slots": planning.layer_slots(groups),
           "bytes_per_block": per_block, "pool_bytes_per_token": per_block / bs,
           "max_model_len": max_len, "blocks_per_max_len_request": req_blocks,
           "bytes_per_max_len_request": req_blocks * per_block}
    if budget_bytes:
        n = planning.num_blocks_for_budget(budget_bytes, groups)
        out.update(budget_bytes=budget_bytes, num_blocks=n, max_len_requests=n // max(req_blocks, 1))
    return out


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{n:,.1f} B"
        n /= 1024
    return str(n)


def run(cfg, words) -> int:
    if words != ["kv"]:
        raise UserError(f"usage: inferhal plan kv model=NAME [cache.block_size=N] [cache.kv_cache_bytes=B]; "
                        f"subcommands: {', '.join(SUBCOMMANDS)}")
    plan = plan_kv(cfg.model, int(cfg.cache.block_size), int(cfg.cache.kv_cache_bytes))
    from inferhal.core.cli.console import console as make_console
    from rich.table import Table

    t = Table(title=f"KV cache plan: {plan['model']}")
    for col in ("group", "kind", "layers", "tokens/slot", "window", "slot B", "B/token/layer", "B/token (group)"):
        t.add_column(col, justify="left" if col in ("group", "kind") else "right")
    for r in plan["groups"]:
        t.add_row(r["group"], r["kind"], str(r["layers"]), str(r["tokens_per_slot"]), str(r["window"] or "-"),
                  str(r["slot_bytes"]), f"{r['bytes_per_token_per_layer']:,.1f}", f"{r['bytes_per_token']:,.1f}")
    t.add_row("total", "", "", "", "", "", "", f"{plan['bytes_per_token']:,.1f}", style="bold")
    con = make_console()
    con.print(t)
    bs = plan["block_size"]
    note = "" if bs == plan["requested_block_size"] else f" (raised from {plan['requested_block_size']} to fit every ratio)"
    con.print(f"KV per token of context: {_human(plan['bytes_per_token'])} summed over groups; "
              f"{_human(plan['bytes_per_token_full_context'])} grows with context, sliding groups cap at "
              f"{_human(plan['sliding_bytes_per_request'])} per request")
    con.print(f"shared pool: block_size {bs}{note}, page {_human(plan['page_bytes'])} x {plan['layer_slots']} layer slots "
              f"= {_human(plan['bytes_per_block'])} per block ({_human(plan['pool_bytes_per_token'])} per token of pool)")
    con.print(f"one request of max_model_len={plan['max_model_len']}: {plan['blocks_per_max_len_request']} blocks = "
              f"{_human(plan['bytes_per_max_len_request'])}")
    if "num_blocks" in plan:
        con.print(f"budget {_human(plan['budget_bytes'])}: {plan['num_blocks']} blocks, "
                  f"{plan['max_len_requests']} requests of max_model_len")
    if cfg.get("output"):
        with open(cfg.output, "w") as f:
            json.dump(plan, f, indent=2)
    return 0
