"""A deployment planned: memory per device, the largest batch and context that fit, and for each decode
batch the step times, tok/s per user and per device, $/Mtok and revenue per device-hour.

:func:`plan` takes the composed root config (``model``, ``parallel``, ``scheduler``, ``cache.kv_dtype``,
``plan``) and a :class:`~inferhal.core.profile.DeviceProfile`; it returns plain data (JSON-ready).
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import mean

from inferhal.core.errors import UserError
from inferhal.core.plan import hardware, roofline
from inferhal.core.plan.inventory import ACT_FORMATS, WEIGHT_FORMATS, Inventory

#: what every plan leaves out; the report prints it
OMITTED = (
    "kernel launch and collective latency (no datasheet gives them; a low-latency decode step of ~1 ms is "
    "dominated by them)",
    "achieved versus peak efficiency: bandwidth and FLOP/s are the profile's peaks",
    "host time (scheduler, Python) between steps",
    "expert load imbalance: experts are evenly loaded (a perfect EPLB)",
    "overlap: phases and the all-to-all add up (no two-batch overlap)",
)

_ACT_BYTES = {"fp4": 0.5 + 1 / 32, "fp8": 1 + 4 / 128, "bfloat16": 2.0, "float32": 4.0}


@dataclass(frozen=True)
class Setup:
    inv: Inventory
    prof: object
    layout: roofline.Layout
    machine: roofline.Machine
    formats: dict
    act: str
    main: roofline.Weights
    draft: roofline.Weights
    notes: tuple = ()


def _fmt(value: str, field: str, auto: str) -> str:
    value = str(value)
    if value == "auto":
        return auto
    if value not in WEIGHT_FORMATS:
        raise UserError(f"plan.{field}={value!r}: use auto or one of {', '.join(WEIGHT_FORMATS)}")
    return value


def setup(cfg, prof, inv: Inventory, layout: roofline.Layout | None = None) -> Setup:
    """Resolve formats, rates and per-class bytes of ``inv`` on ``prof`` under ``cfg.plan``."""
    p = cfg.plan
    ck = inv.checkpoint_formats
    formats = {"experts": _fmt(p.experts_format, "experts_format", ck.get("experts", inv.dtype)),
               "dense": _fmt(p.dense_format, "dense_format", ck.get("dense", inv.dtype)),
               "head": ck.get("head", inv.dtype), "embed": ck.get("embed", inv.dtype)}
    if not inv.n_experts and str(p.experts_format) != "auto":
        raise UserError(f"plan.experts_format={p.experts_format!r}: {inv.name} has no routed experts (leave it auto)")
    act = str(p.activation_format)
    if act == "auto":
        act = "fp8" if formats["dense"] in ("fp8", "fp4", "nvfp4") else inv.dtype
    if act not in ACT_FORMATS:
        raise UserError(f"plan.activation_format={act!r}: use auto or one of {', '.join(ACT_FORMATS)}")
    layout = layout or roofline.Layout(int(cfg.parallel.tp), int(cfg.parallel.dp), int(cfg.parallel.ep))
    if inv.moe_layers == 0 and layout.ep > 1:
        raise UserError(f"parallel.ep={layout.ep}: {inv.name} has no routed experts to spread")
    up, out = hardware.links(prof)
    attn_dtype = inv.dtype if prof.peak_flops.get(inv.dtype) else ACT_FORMATS[act]
    expert_rate, notes = 0.0, []
    if formats["experts"] in ("fp4", "nvfp4") and not prof.supports("fp4_grouped_gemm"):
        # the device stores FP4 experts but has no FP4 grouped GEMM: they are widened and multiplied in bf16
        expert_rate = hardware.rate(prof, "bfloat16")
        notes.append(f"{prof.device_name} lacks fp4_grouped_gemm: FP4 expert products counted at its bfloat16 peak")
    machine = roofline.Machine(hardware.bandwidth(prof), hardware.rate(prof, ACT_FORMATS[act]),
                               hardware.rate(prof, attn_dtype), up, out, expert_rate)

    def weights(prefix: str) -> roofline.Weights:
        return roofline.Weights(
            dense_bytes=inv.bytes(prefix + "dense", formats["dense"]), dense_params=inv.params(prefix + "dense"),
            head_bytes=inv.bytes("head", formats["head"]), head_params=inv.params("head"),
            expert_bytes=inv.bytes(prefix + "experts", formats["experts"]) / max(_moe_layers(inv, prefix) * inv.n_experts, 1),
            expert_params=inv.params(prefix + "experts") / max(_moe_layers(inv, prefix) * inv.n_experts, 1),
            n_experts=inv.n_experts, top_k=inv.top_k, moe_layers=_moe_layers(inv, prefix), hidden=inv.hidden,
            act_bytes=_ACT_BYTES[act], kv_heads=inv.kv_heads, layers=inv.layers if not prefix else 1)

    return Setup(inv, prof, layout, machine, formats, act, weights(""), weights("mtp_"), tuple(notes))


def _moe_layers(inv: Inventory, prefix: str) -> int:
    if not inv.n_experts:
        return 0
    if not prefix:
        return inv.moe_layers
    per_layer = inv.expert_params() * inv.n_experts
    return round(inv.params(prefix + "experts") / per_layer) if per_layer else 0


def memory(s: Setup, cfg, step_rows: int = 1) -> dict:
    """Bytes per device: weights by class and format, activations (estimate), reserve, what is left for KV.
    Activations: the widest step, a prefill chunk (``scheduler.max_num_batched_tokens``) or ``step_rows``
    decode rows (the largest swept batch x (drafts + 1)), and fp32 logits for ``step_rows`` rows."""
    inv, lay, f = s.inv, s.layout, s.formats
    drafts = int(cfg.plan.draft_tokens) > 0
    split_experts = lay.ep if lay.ep > 1 else lay.tp
    w = {"dense": inv.bytes("dense", f["dense"]) / lay.tp, "experts": inv.bytes("experts", f["experts"]) / split_experts,
         "head": inv.bytes("head", f["head"]) / lay.tp, "embed": inv.bytes("embed", f["embed"]) / lay.tp,
         "small": inv.bytes("small", inv.dtype) + inv.bytes("table", inv.dtype)}
    if drafts:
        w["mtp"] = (inv.bytes("mtp_dense", f["dense"]) / lay.tp + inv.bytes("mtp_experts", f["experts"]) / split_experts
                    + inv.bytes("mtp_small", inv.dtype))
    tokens = max(int(cfg.scheduler.max_num_batched_tokens), step_rows)
    act = (tokens * inv.act_bytes_per_token + step_rows * inv.vocab * 4) / lay.tp
    usable = s.prof.memory_bytes * float(cfg.plan.memory_utilization)
    weights = sum(w.values())
    free = usable - weights - act - int(cfg.plan.reserved_bytes)
    return {"device_bytes": s.prof.memory_bytes, "usable_bytes": usable, "weights": w, "weights_bytes": weights,
            "activations_bytes": act, "reserved_bytes": int(cfg.plan.reserved_bytes), "kv_free_bytes": free}


def kv_per_device(s: Setup, batch: int, n: float) -> float:
    return batch * s.inv.kv_stored(n) / min(s.layout.tp, s.inv.kv_heads)


def max_batch(s: Setup, free: float, n: float) -> int:
    per = kv_per_device(s, 1, n)
    return int(free // per) if free > 0 and per > 0 else 0


def max_context(s: Setup, free: float, batch: int, limit: int) -> int:
    """The longest context ``batch`` requests per attention rank can each hold (bisection; KV grows with n)."""
    if free <= 0 or kv_per_device(s, batch, 1) > free:
        return 0
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if kv_per_device(s, batch, mid) <= free else (lo, mid - 1)
    return lo


def prefill_s(s: Setup, tokens: float, start: float, chunk: int, layout: roofline.Layout | None = None) -> float:
    """Seconds to prefill ``tokens`` new tokens after ``start`` cached ones, one request per attention rank,
    in chunks of ``chunk`` tokens (``scheduler.max_num_batched_tokens``)."""
    lay, t, pos, left = layout or s.layout, 0.0, float(start), float(tokens)
    while left > 0:
        c = min(chunk, left)
        fl = c * (s.inv.attn_flops(pos) + s.inv.attn_flops(pos + c)) / 2
        t += roofline.step(c, 1, s.inv.kv_stored(pos), fl, s.main, lay, s.machine)["s"]
        pos, left = pos + c, left - c
    return t


def tokens_per_cycle(k: int, a: float) -> float:
    """Expected tokens one verify step emits with ``k`` chained drafts, each accepted with probability ``a``
    given the ones before it: 1 + a + ... + a^k."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def plan(cfg, prof, inv: Inventory) -> dict:
    """The whole plan (see the module docstring)."""
    p, tr = cfg.plan, cfg.plan.traffic
    prompts, outputs = [int(x) for x in tr.prompt_tokens], [int(x) for x in tr.output_tokens]
    batches = [int(b) for b in tr.batch_sizes]
    hit, k, a = float(tr.prefix_hit_rate), int(p.draft_tokens), float(p.acceptance)
    checks = [(not prompts or min(prompts) < 1, "plan.traffic.prompt_tokens needs values >= 1"),
              (not outputs or min(outputs) < 1, "plan.traffic.output_tokens needs values >= 1"),
              (not batches or min(batches) < 1, "plan.traffic.batch_sizes needs values >= 1"),
              (not 0 <= hit < 1, f"plan.traffic.prefix_hit_rate={hit} must be in [0, 1)"),
              (k < 0, f"plan.draft_tokens={k} must be >= 0"), (not 0 <= a <= 1, f"plan.acceptance={a} must be in [0, 1]"),
              (k > 0 and not inv.params("mtp_dense"), f"plan.draft_tokens={k}: {inv.name} has no MTP layer"),
              (int(p.prefill_gpus) < 0, "plan.prefill_gpus must be >= 0"),
              (not 0 < float(p.memory_utilization) <= 1, "plan.memory_utilization must be in (0, 1]"),
              (float(tr.arrival_rate) < 0, "plan.traffic.arrival_rate must be >= 0")]
    for bad, msg in checks:
        if bad:
            raise UserError(msg)
    s = setup(cfg, prof, inv)
    lay = s.layout
    limit = int(cfg.model.max_model_len)
    n_fit = max(prompts) + max(outputs)
    if n_fit > limit:
        raise UserError(f"plan.traffic: a request of {max(prompts)} + {max(outputs)} tokens exceeds model.max_model_len={limit}")
    n_mean, out_mean, in_mean = mean(prompts) + mean(outputs) / 2, mean(outputs), mean(prompts)
    mem = memory(s, cfg, max(batches) * (k + 1))
    free = mem["kv_free_bytes"]
    if free <= 0:
        raise UserError(f"{inv.name} does not fit on {prof.device_name} with layout tp={lay.tp} dp={lay.dp} ep={lay.ep}: "
                        f"weights {mem['weights_bytes'] / 1e9:.1f} GB + activations {mem['activations_bytes'] / 1e9:.1f} GB "
                        f"exceed {mem['usable_bytes'] / 1e9:.1f} GB usable per device")
    chunk = int(cfg.scheduler.max_num_batched_tokens)
    pf = prefill_s(s, in_mean * (1 - hit), in_mean * hit, chunk)
    P = int(p.prefill_gpus)
    if P:
        pool = roofline.Layout(1, P, P if inv.moe_layers else 1)
        pool_mem = memory(setup(cfg, prof, inv, pool), cfg)
        if pool_mem["kv_free_bytes"] <= 0:
            raise UserError(f"plan.prefill_gpus={P}: {P} device(s) cannot hold {inv.name} "
                            f"({pool_mem['weights_bytes'] / 1e9:.1f} GB of weights each, "
                            f"{pool_mem['usable_bytes'] / 1e9:.1f} GB usable)")
        pool_s = prefill_s(s, in_mean * (1 - hit), in_mean * hit, chunk, pool)
    tpc = tokens_per_cycle(k, a)
    devices = lay.devices + P
    rows = []
    for b in batches:
        q = k + 1
        ver = roofline.step(b * q, b * q, b * inv.kv_read(n_mean), b * q * inv.attn_flops(n_mean), s.main, lay, s.machine)
        dr = roofline.step(b, b, b * inv.mtp_kv_read(n_mean), b * inv.mtp_attn_flops(n_mean), s.draft, lay, s.machine) \
            if k else {"s": 0.0, "phases": {}}
        cycle = ver["s"] + k * dr["s"]
        user_decode = tpc / cycle
        D = b * lay.dp * tpc / cycle  # output tok/s of the decode devices while they decode
        if P:
            capacity = P / pool_s * out_mean  # output tok/s the prefill pool can feed
            rate, user, limited = min(D, capacity), user_decode, "prefill" if capacity < D else "decode"
        else:
            t_pf = pf / lay.dp  # instance seconds of prefill per request (every rank prefills one at once)
            share = D * t_pf / (out_mean + D * t_pf)
            rate, user, limited = D * (1 - share), user_decode * (1 - share), "-"
        out_dev = rate / devices
        in_dev = rate / out_mean * in_mean / devices
        row = {"batch": b, "fits": b <= max_batch(s, free, n_fit), "step_ms": ver["s"] * 1e3,
               "draft_ms": dr["s"] * 1e3, "cycle_ms": cycle * 1e3, "tokens_per_step": tpc, "tok_s_user": user,
               "tpot_ms": 1e3 / user, "tok_s_device": out_dev, "in_tok_s_device": in_dev,
               "total_tok_s_device": out_dev + in_dev, "ttft_ms": (pool_s if P else pf) * 1e3, "limited_by": limited,
               "bound": {n: ph["bound"] for n, ph in ver["phases"].items()},
               "phases_ms": {n: ph["s"] * 1e3 for n, ph in ver["phases"].items()},
               "kv_bytes": kv_per_device(s, b, n_fit)}
        if float(p.gpu_hour_usd):
            row["usd_per_mtok"] = float(p.gpu_hour_usd) / 3600 / out_dev * 1e6
        prices = (float(p.price_output_usd), float(p.price_input_usd), float(p.price_cached_input_usd))
        if any(prices):
            row["revenue_per_device_hour"] = 3600 * (out_dev * prices[0] + in_dev * ((1 - hit) * prices[1] + hit * prices[2])) / 1e6
        rows.append(row)
    fit_rows = [r for r in rows if r["fits"]]
    front = [r["batch"] for r in fit_rows
             if not any(o["tok_s_user"] >= r["tok_s_user"] and o["tok_s_device"] >= r["tok_s_device"]
                        and (o["tok_s_user"], o["tok_s_device"]) != (r["tok_s_user"], r["tok_s_device"]) for o in fit_rows)]
    out = {"model": inv.name, "device": prof.device_name, "device_sources": dict(prof.sources),
           "layout": {"tp": lay.tp, "dp": lay.dp, "ep": lay.ep, "decode_devices": lay.devices, "prefill_devices": P},
           "formats": dict(s.formats, activations=s.act), "kv_dtype": str(cfg.cache.kv_dtype),
           "links": {k2: (v.__dict__ if v else None) for k2, v in zip(("scale_up", "scale_out"), (s.machine.scale_up, s.machine.scale_out))},
           "rates": {"bandwidth": s.machine.bandwidth, "products": s.machine.product_rate, "attention": s.machine.attention_rate},
           "traffic": {"prompt_mean": in_mean, "output_mean": out_mean, "context_mean": n_mean, "context_fit": n_fit,
                       "prefix_hit_rate": hit, "draft_tokens": k, "acceptance": a},
           "memory": mem, "kv_bytes_per_request_fit": inv.kv_stored(n_fit),
           "max_batch": max_batch(s, free, n_fit),
           "max_context": {str(b): max_context(s, free, b, limit) for b in batches},
           "rows": rows, "pareto": front, "omitted": list(OMITTED), "notes": [*inv.notes, *s.notes]}
    lam = float(tr.arrival_rate)
    if lam:
        need = lam * out_mean / devices
        meets = [r for r in fit_rows if r["tok_s_device"] >= need]
        out["arrival"] = {"rate": lam, "output_tok_s_device_needed": need,
                          "batch": meets[0]["batch"] if meets else None,
                          "tok_s_user": meets[0]["tok_s_user"] if meets else None}
    return out
