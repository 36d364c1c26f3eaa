"""``inferhal bench kv_capacity``: how many requests of a given length fit a KV budget, per model and KV dtype.

Pure planning (no weights, no timing): for DeepSeek-V4-Flash (auto = bf16, fp8, fp4) and the V4.1-Flash
planning config (fp4), at contexts from 4K to 128K tokens, the requests of that length that
``cache.kv_cache_bytes`` (default 8 GiB) holds at once with one block pool per layer group
(:mod:`inferhal.core.paging.planning`), and, for V4-Flash in bf16, with the former single shared pool that
padded every page to the largest group's page (22 MiB per 128-token block). Table, JSON and a plot under
``bench.output_dir``.
"""

from __future__ import annotations

from pathlib import Path

from inferhal.core.bench import write_json

CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)
CASES = (("deepseek_v4_flash", "auto"), ("deepseek_v4_flash", "fp8"), ("deepseek_v4_flash", "fp4"),
         ("deepseek_v4_1_flash", "fp4"))
GIB = 1 << 30


def shared_pool_requests(specs, block_size: int, context: int, budget: int) -> int:
    """Requests of ``context`` tokens the former shared pool held: every page padded to the largest page,
    every block as many layer slots as the largest group has layers."""
    from inferhal.core.paging import planning
    from inferhal.core.paging.kv_manager import KVCacheManager

    lay = planning.layouts(specs, block_size)
    page = max(planning.page_bytes(g) for g in lay)
    per_block = page * max(len(g.layers) for g in lay)
    held = sum(KVCacheManager(specs, block_size, 1, enable_caching=False).blocks_for(context).values())
    return int(budget // per_block) // max(held, 1)


def run(cfg) -> int:
    from inferhal.core.plan.kv import kv_groups_for, plan_kv
    from inferhal.core.console import console
    from inferhal.core.config.compose import compose
    from inferhal.core.paging import planning
    from rich.table import Table

    budget = int(cfg.cache.kv_cache_bytes) or 8 * GIB
    seqs = int(cfg.scheduler.max_num_seqs)
    rows = []
    for model, dtype in CASES:
        mc = compose([f"model={model}"], "plan kv").model
        for ctx in CONTEXTS:
            mc.max_model_len = ctx
            plan = plan_kv(mc, 16, budget, seqs, int(cfg.scheduler.max_num_batched_tokens), dtype)
            row = {"model": model, "kv_dtype": dtype, "context": ctx, "requests": plan["max_len_requests"],
                   "global_bytes_per_token": plan["bytes_per_token_full_context"],
                   "planned_over_stored": plan["planned_over_stored"]}
            if dtype == "auto":
                specs = kv_groups_for(mc)
                row["requests_shared_pool"] = shared_pool_requests(specs, planning.compatible_block_size(specs, 16),
                                                                   ctx, budget)
            rows.append(row)
    t = Table(title=f"requests of each length in a {budget / GIB:g} GiB KV budget (max_num_seqs {seqs}; planning)")
    t.add_column("model / kv_dtype")
    t.add_column("global B/token", justify="right")
    for ctx in CONTEXTS:
        t.add_column(f"{ctx // 1024}K", justify="right")
    for model, dtype in CASES:
        mine = [r for r in rows if r["model"] == model and r["kv_dtype"] == dtype]
        t.add_row(f"{model} / {dtype}", f"{mine[0]['global_bytes_per_token']:,.0f}", *(str(r["requests"]) for r in mine))
        if dtype == "auto":
            t.add_row(f"{model} / {dtype}, one shared padded pool (before)", "",
                      *(str(r["requests_shared_pool"]) for r in mine))
    console(min_width=120).print(t)
    data = Path(write_json(cfg, "kv_capacity.json", {"budget_bytes": budget, "max_num_seqs": seqs, "rows": rows}))
    plot = data.with_suffix(".png")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"table and {data} written; no plot (matplotlib is not installed)")
        return 0
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for model, dtype in CASES:
        mine = [r for r in rows if r["model"] == model and r["kv_dtype"] == dtype]
        ax.plot([r["context"] for r in mine], [max(r["requests"], 0.5) for r in mine], marker="o",
                label=f"{model} {dtype}")
        if dtype == "auto":
            ax.plot([r["context"] for r in mine], [max(r["requests_shared_pool"], 0.5) for r in mine], "k--",
                    marker="x", label=f"{model} {dtype}: shared padded pool (before)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("requests at once (0 drawn at 0.5)")
    ax.set_title(f"KV capacity in {budget / GIB:g} GiB (planning, max_num_seqs {seqs})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(plot, dpi=120)
    print(f"wrote {data} and {plot}")
    return 0
