"""Bounds of a decode step that a benchmark row can be held to, each with the share of it reached.

- **weight streaming** (:func:`add_weight_bounds`): a step that reads its weights from memory once takes at
  least ``bytes / bandwidth``, so ``c`` running requests get at most ``c × bandwidth / bytes`` tok/s;
- **product rate** (:func:`add_compute_bounds`): a step computes its tokens' weight products, at best at the
  rate the engine's products reach on a large product, so at most ``rate / flops per token`` tok/s.

Rows are :func:`inferhal.core.bench.e2e.summarize` rows carrying the host readings (``read_gbs``,
``product_gflops``) that :func:`inferhal.core.bench.e2e.measure` takes at each level.
"""

from __future__ import annotations

from typing import Sequence


def add_weight_bounds(rows: Sequence[dict], weight_bytes: dict[str, int]) -> None:
    """Give each row of an engine in ``weight_bytes`` (weight bytes one decode step reads) its bytes and,
    where the level measured the host's read bandwidth, ``bound_tok_s``: ``c`` tokens per step when a step
    takes only the time to stream those weights once (prefill, activations, KV, logits and every other cost
    left out, so no engine that streams its weights can exceed it)."""
    for r in rows:
        nbytes = weight_bytes.get(r["engine"])
        if not nbytes:
            continue
        r["weight_bytes_per_step"] = nbytes
        if r.get("read_gbs"):
            r["bound_tok_s"] = r["concurrency"] * r["read_gbs"] * 1e9 / nbytes


def add_compute_bounds(rows: Sequence[dict], flops_per_token: dict[str, int]) -> None:
    """Give each row of an engine in ``flops_per_token`` (its weight products' flops per decoded token) those
    flops and, where the level measured its products' rate, ``compute_bound_tok_s``: tokens per second when a
    step takes only the time of its products at that rate (whatever ``c``: each token costs the same
    products; prefill, attention and every other cost left out)."""
    for r in rows:
        flops = flops_per_token.get(r["engine"])
        if not flops:
            continue
        r["product_flops_per_token"] = flops
        if r.get("product_gflops"):
            r["compute_bound_tok_s"] = r["product_gflops"] * 1e9 / flops


def bound_lines(rows: Sequence[dict]) -> list[str]:
    """One line per bound of a row (:func:`add_weight_bounds`, :func:`add_compute_bounds`): what it rests on,
    the step it implies, and the share of it reached. A row with ``bounds_without_head`` says that its
    bytes and flops leave the LM head out (its greedy steps run ``lm_head.argmax`` instead)."""
    out = []
    for r in rows:
        products = "its products other than the LM head" if r.get("bounds_without_head") else "its products"
        weights = "weights other than the LM head" if r.get("bounds_without_head") else "weights"
        if "compute_bound_tok_s" in r:
            step_ms = 1e3 * r["concurrency"] / r["compute_bound_tok_s"]
            share = r["tok_s"] / r["compute_bound_tok_s"]
            out.append(f"{r['engine']} c={r['concurrency']}: {products} cost "
                       f"{r['product_flops_per_token'] / 1e6:.0f} MFLOP a token; at the {r['product_gflops']:.0f} "
                       f"GFLOP/s they reach on a large product that is >= {step_ms:.0f} ms a step, "
                       f"<= {r['compute_bound_tok_s']:.0f} tok/s; reached {r['tok_s']:.1f} "
                       + (f"({100 * share:.0f}% of that bound)" if share <= 1 else
                          "- above it: the large product ran slower than the step's products did; no bound"))
        if "bound_tok_s" not in r:
            continue
        step_ms = 1e3 * r["concurrency"] / r["bound_tok_s"]
        mb = r["weight_bytes_per_step"] / 1e6
        line = (f"{r['engine']} c={r['concurrency']}: reads {mb:.0f} MB of {weights} "
                f"per decode step; at the host's {r['read_gbs']:.1f} GB/s that is >= {step_ms:.0f} ms a step, "
                f"<= {r['bound_tok_s']:.0f} tok/s; reached {r['tok_s']:.1f} ")
        if r["tok_s"] <= r["bound_tok_s"]:
            line += f"({100 * r['tok_s'] / r['bound_tok_s']:.0f}% of that bound)"
        else:  # a measured rate cannot pass a true bound: the bandwidth readings missed the level's best spell
            line += (f"- above it, so the bandwidth readings ({r.get('read_gbs_start', 0):.1f} before, "
                     f"{r.get('read_gbs_end', 0):.1f} after the level) missed the host's faster spells; no bound")
        out.append(line)
    return out
