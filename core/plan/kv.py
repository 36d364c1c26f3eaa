"""A model family's KV layer groups from its config alone (no weights), and what they take: what ``inferhal plan
kv``, the planner and ``bench kv_capacity`` size."""

from __future__ import annotations

import importlib
import inspect

from inferhal.core.errors import UserError
from inferhal.core.paging import formats, planning
from inferhal.core.paging.kv_manager import KVCacheManager


def kv_groups_for(model_cfg, kv_dtype: str = "auto"):
    try:
        mod = importlib.import_module(f"inferhal.core.models.{model_cfg.family}")
    except ImportError as exc:
        raise UserError(f"model family {model_cfg.family!r} cannot be imported: {exc}") from None
    fn = getattr(mod, "kv_groups_from_config", None)
    if fn is None:
        raise UserError(f"model family {model_cfg.family!r} offers no kv_groups_from_config(model_cfg), so its KV "
                        f"cannot be planned without loading the model")
    if kv_dtype not in formats.KV_DTYPES:
        raise UserError(f"cache.kv_dtype must be one of {', '.join(formats.KV_DTYPES)}, got {kv_dtype!r}")
    if kv_dtype == "auto":
        return list(fn(model_cfg))
    if "kv_dtype" not in inspect.signature(fn).parameters:
        raise UserError(f"model family {model_cfg.family!r} plans only cache.kv_dtype=auto (its KV groups name no "
                        f"quantised record formats)")
    return list(fn(model_cfg, kv_dtype=kv_dtype))


def plan_kv(model_cfg, block_size: int, budget_bytes: int = 0, max_num_seqs: int = 64,
            max_step_tokens: int = 2048, kv_dtype: str = "auto") -> dict:
    """The plan as data: per group its bytes per token and per block, what one request of
    ``max_model_len`` tokens stores and what its blocks take, and what ``budget_bytes`` holds."""
    specs = kv_groups_for(model_cfg, kv_dtype)
    bs = planning.compatible_block_size(specs, block_size)
    groups = planning.layouts(specs, bs)
    max_len = int(model_cfg.max_model_len)
    kv = KVCacheManager(specs, bs, 1, enable_caching=False)
    held = kv.blocks_for(max_len)  # blocks one max_model_len request holds, per group (sliding: its window)
    rows = []
    for s, g in zip(specs, groups):
        stored_tokens = min(s.window, max_len) if s.kind == "sliding" else max_len
        rows.append({"group": s.name, "kind": s.kind, "layers": len(s.layers), "tokens_per_slot": s.tokens_per_slot,
                     "window": s.window, "slot_bytes": s.slot_bytes(), "record": s.record,
                     "bytes_per_token_per_layer": s.slot_bytes() / s.tokens_per_slot,
                     "bytes_per_token": s.bytes_per_token(), "page_bytes": planning.page_bytes(g),
                     "block_bytes": planning.group_block_bytes(g), "blocks_per_max_len_request": held[s.name],
                     "stored_bytes_per_max_len_request": s.bytes_per_token() * stored_tokens,
                     "planned_bytes_per_max_len_request": held[s.name] * planning.group_block_bytes(g)})
    stored = sum(r["stored_bytes_per_max_len_request"] for r in rows)
    planned = sum(r["planned_bytes_per_max_len_request"] for r in rows)
    out = {"model": str(model_cfg.name), "kv_dtype": kv_dtype, "block_size": bs, "requested_block_size": block_size,
           "groups": rows,
           "bytes_per_token": sum(r["bytes_per_token"] for r in rows),
           "bytes_per_token_full_context": sum(r["bytes_per_token"] for r in rows if r["kind"] != "sliding"),
           "sliding_bytes_per_request": sum(r["bytes_per_token"] * r["window"] for r in rows if r["kind"] == "sliding"),
           "max_model_len": max_len, "stored_bytes_per_max_len_request": stored,
           "bytes_per_max_len_request": planned, "planned_over_stored": planned / stored if stored else 0.0}
    if budget_bytes:
        n = planning.blocks_for_budget(specs, bs, budget_bytes, max_num_seqs, max_step_tokens, max_len)
        fits = min(n[s.name] // max(held[s.name], 1) for s in specs)
        out.update(budget_bytes=budget_bytes, max_num_seqs=max_num_seqs, num_blocks=n,
                   allocated_bytes=planning.storage_bytes(planning.layouts(specs, bs, n)), max_len_requests=fits)
    return out
