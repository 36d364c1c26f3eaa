"""``inferhal bench e2e model=gemma3_270m``: end-to-end serving numbers against transformers and llama.cpp.

At each ``bench.concurrency`` level ``c`` (default 1, 8, 32), ``n = max(c, min(bench.num_prompts, 4c))``
requests of ``bench.max_tokens`` greedy tokens (EOS ignored, so every engine emits exactly that many)
run with at most ``c`` in flight, from the same token-id prompts, on:

- **inferhal**: the engine, closed loop: ``c`` requests in flight, a new one added when one finishes. TTFT = submit → first token; TPOT = (last − first token) / (tokens − 1).
- **transformers** (``bench.peers`` contains ``transformers``): ``AutoModelForCausalLM`` on the same
  GGUF (``gguf_file=``), once in every dtype inferhal runs in (rows ``transformers`` in ``model.dtype`` and
  ``transformers-bf16``), ``generate`` on batches of ``c`` prompts, left padding: the ``c`` clients submit
  together once the previous batch is done (static batching). A logits processor stamps each step; every
  request in a batch shares its batch's times.
- **llama.cpp** (``llama_cpp`` in ``bench.peers``, the optional ``llama-cpp-python``): ``Llama`` on
  the same GGUF with as many threads as torch uses. It serves one request at a time, so ``c`` clients
  queue FIFO and a request's TTFT includes its wait.

With ``model.dtype=float32`` (the default) inferhal also runs a second time in bfloat16
(``inferhal-bf16``: weights cast once at load, bf16 activations and KV, fp32 logits), since CPU GEMMs
with AVX512-BF16 run ~2-4x faster; transformers runs in both, so every dtype has a like-for-like ratio.
Fidelity tests stay fp32.

inferhal runs without prefix caching: the repeats send the same prompts, and a cached block would spare
inferhal prefill work that transformers and llama.cpp redo. Every engine is loaded first; then each level
runs ``bench.repeats`` times with the engines interleaved (their order rotated each repeat), so a slow
spell of a shared machine falls on all of them. A row is the repeat with the median tok/s; a ratio is
the median over repeats of the paired ratios.

Aggregate tok/s = output tokens / wall time of the level. Reported: a rich table, ratios
(every inferhal engine / every peer row) per level, ``<bench.output_dir>/e2e.json`` (or ``output=``) and ``e2e.png``.
A peer that cannot run is reported as not measured, with the reason. Timings are wall-clock on
whatever machine runs it; the exit status says only whether the benchmark ran.

What the host did is recorded beside the timings (:mod:`.host`): each repeat's hypervisor steal (the share
of CPU time a shared VM's vCPUs waited for the host; column ``steal %`` of the median row, every repeat's in
the JSON), and at each level the memory read bandwidth measured then. For models that say how many weight
bytes a decode step reads (``step_weight_bytes()``), each inferhal row gets the weight-streaming bound
``c × bandwidth / bytes`` tok/s, printed with the share of it reached and drawn dashed in the plot: at
high concurrency a CPU engine that reads its weights from memory every step cannot pass it. For models that
say what their weight products cost per token (``token_product_flops()``), each inferhal row also gets the
product-rate bound ``rate / flops`` tok/s, where ``rate`` is what the engine's own ``linear`` reaches on a
large product, measured before and after the level (drawn dotted): once the weights are streamed fast
enough, a decode step still has to compute its products, and the share of this bound reached is the
engine's efficiency around them (prefill, attention, small ops, Python). Where the engine's greedy steps
take their tokens from ``lm_head.argmax`` (the runner's ``greedy_head``), both bounds leave the LM head out
(``head=False``): that op may read and compute less than the head (cpu_avx512's int8 screen), so only the
rest of the step is a floor.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
from typing import Callable, Sequence

from inferhal.core.bench import host
from inferhal.core.bench.bounds import add_compute_bounds, add_weight_bounds, bound_lines
from inferhal.core.bench.clients import PEERS, peer_loaders, prompt_ids, run_inferhal, run_llama_cpp, run_transformers
from inferhal.core.bench.stamp import stamp

def _pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(engine: str, c: int, wall: float, per_req: Sequence[tuple[float, float, int]]) -> dict:
    """per_req: (ttft_s, tpot_s, output tokens) per request."""
    toks = sum(n for _, _, n in per_req)
    ttft = [t for t, _, _ in per_req]
    tpot = [p for _, p, n in per_req if n > 1]
    return {"engine": engine, "concurrency": c, "requests": len(per_req), "output_tokens": toks, "wall_s": wall,
            "tok_s": toks / wall if wall > 0 else 0.0,
            "ttft_p50_ms": 1e3 * _pct(ttft, 0.5), "ttft_p95_ms": 1e3 * _pct(ttft, 0.95),
            "tpot_p50_ms": 1e3 * _pct(tpot, 0.5), "tpot_p95_ms": 1e3 * _pct(tpot, 0.95)}


# -- orchestration -------------------------------------------------------------------------------------

def speed_ratios(rows: Sequence[dict], engines: Sequence[str]) -> dict[str, float]:
    """``{"<engine>_vs_<peer>@<c>": tok/s ratio}`` for every inferhal engine against every other row's engine
    at the same concurrency (the ``inferhal_`` prefix is dropped from the plain engine's keys). Rows that
    carry ``tok_s_repeats`` (interleaved repeats, in the same order) give the median of the paired ratios,
    so a slow spell of the machine during one repeat weighs on both sides of it."""
    out = {}
    for r in rows:
        if r["engine"] in engines:
            continue
        for engine in engines:
            ours = [x for x in rows if x["engine"] == engine and x["concurrency"] == r["concurrency"]]
            if not ours:
                continue
            a, b = ours[0].get("tok_s_repeats", [ours[0]["tok_s"]]), r.get("tok_s_repeats", [r["tok_s"]])
            pairs = [x / y for x, y in zip(a, b) if y > 0] if len(a) == len(b) else \
                ([ours[0]["tok_s"] / r["tok_s"]] if r["tok_s"] > 0 else [])
            if pairs:
                key = ("" if engine == "inferhal" else f"{engine}_") + f"vs_{r['engine']}@{r['concurrency']}"
                out[key] = statistics.median(pairs)
    return out


def median_row(samples: Sequence[dict]) -> dict:
    """The repeat with the median tok/s (the lower median for an even count), with every repeat's tok/s."""
    ranked = sorted(samples, key=lambda r: r["tok_s"])
    row = {**ranked[(len(ranked) - 1) // 2], "tok_s_repeats": [r["tok_s"] for r in samples]}
    if any("steal" in r for r in samples):
        row["steal_repeats"] = [r.get("steal") for r in samples]
    return row


def measure(runners: dict[str, Callable], prompts: Sequence[list[int]], levels: Sequence[int], num_prompts: int,
            max_tokens: int, repeats: int, log: Callable[[str], None] = print,
            cpu_times: Callable[[], tuple[int, int] | None] = host.cpu_times,
            bandwidth: Callable[[], float] | None = None,
            product_rates: dict[str, Callable[[], float]] | None = None) -> list[dict]:
    """Every engine at every level, ``repeats`` times, engines interleaved (their order rotated each repeat)
    so machine noise spreads over all of them → one :func:`median_row` per (engine, level).

    Each repeat records the share of CPU time the hypervisor took while it ran (``steal``, from
    ``cpu_times``; None off Linux). ``bandwidth`` (bytes/s) is measured before and after each level; every
    row of the level gets both (``read_gbs_start``, ``read_gbs_end``) and the larger as ``read_gbs``, the
    host's best observed rate during the level, for :func:`.bounds.add_weight_bounds`. ``product_rates`` (engine ->
    flop/s of its own products on a large product, :func:`host.product_rate`) are measured the same way
    (``product_gflops_start``, ``_end``, and the larger as ``product_gflops``), for :func:`.bounds.add_compute_bounds`."""
    names = list(runners)
    product_rates = product_rates or {}
    rows = []
    for c in levels:
        n = max(c, min(num_prompts, 4 * c))
        got: dict[str, list[dict]] = {e: [] for e in names}
        start = bandwidth() / 1e9 if bandwidth is not None else None
        rate0 = {e: f() / 1e9 for e, f in product_rates.items()}
        for rep in range(repeats):
            k = rep % len(names)
            for e in names[k:] + names[:k]:
                before = cpu_times()
                wall, per = runners[e](prompts[:n], c, max_tokens)
                steal = host.steal_share(before, cpu_times())
                got[e].append({**summarize(e, c, wall, per), "steal": steal})
                log(f"{e} c={c} repeat {rep + 1}/{repeats}: {got[e][-1]['tok_s']:.1f} tok/s"
                    + (f" (hypervisor steal {100 * steal:.0f}%)" if steal is not None else ""))
        level = [median_row(got[e]) for e in names]
        if start is not None:
            end = bandwidth() / 1e9
            log(f"c={c}: host memory read bandwidth {start:.1f} GB/s before the level, {end:.1f} GB/s after")
            for r in level:
                r.update(read_gbs_start=start, read_gbs_end=end, read_gbs=max(start, end))
        for e, f in product_rates.items():
            end = f() / 1e9
            log(f"c={c}: {e}'s products reach {rate0[e]:.0f} GFLOP/s on a large product before the level, "
                f"{end:.0f} after")
            for r in level:
                if r["engine"] == e:
                    r.update(product_gflops_start=rate0[e], product_gflops_end=end, product_gflops=max(rate0[e], end))
        rows += level
    return rows


def inferhal_variants(dtype: str) -> list[tuple[str, str]]:
    """(engine name, model.dtype) of each inferhal run: ``model.dtype``, plus bfloat16 when that is fp32."""
    out = [("inferhal", dtype)]
    if dtype == "float32":
        out.append(("inferhal-bf16", "bfloat16"))
    return out


def run(cfg) -> int:
    import torch
    from inferhal.core.console import console as make_console
    from rich.table import Table

    from inferhal.core.engine.llm import LLM

    console = make_console(min_width=120)
    b = cfg.bench
    levels = [int(c) for c in b.concurrency]
    max_tokens = int(b.max_tokens)
    peers = [str(p) for p in b.peers] or list(PEERS)
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        from inferhal.core.errors import UserError

        raise UserError(f"bench.peers: unknown peer(s) {unknown}; known: {', '.join(PEERS)}")

    cfg.scheduler.max_num_seqs = max(levels)
    cfg.cache.enable_prefix_caching = False  # every repeat prefills every prompt, as the peers do
    notes: dict[str, str] = {}
    info: dict = {}
    prompts: list[list[int]] = []
    tok = None
    n_max = max(max(c, min(int(b.num_prompts), 4 * c)) for c in levels)
    variants = inferhal_variants(str(cfg.model.dtype))
    runners: dict[str, Callable] = {}  # engine -> (prompts, c, max_tokens) -> (wall, per request)
    weight_bytes: dict[str, int] = {}  # inferhal engine -> weight bytes one decode step reads
    token_flops: dict[str, int] = {}  # inferhal engine -> its products' flops per decoded token
    rates: dict[str, Callable[[], float]] = {}  # inferhal engine -> flop/s its products reach, measured now
    no_head: set[str] = set()  # inferhal engines whose bounds leave the LM head out
    for engine, dtype in variants:
        cfg.model.dtype = dtype
        t = time.perf_counter()
        llm = LLM.from_config(cfg)
        if tok is None:
            tok = llm.tokenizer
            info = dict(llm.engine.loaded.info)
            prompts = prompt_ids(tok, n_max)
        notes[engine] = f"backend={cfg.backend.name}, dtype={dtype}, load {time.perf_counter() - t:.1f} s"
        if cfg.spec.method != "none":
            notes[engine] += f", spec={cfg.spec.method} ({cfg.spec.num_speculative_tokens} drafts per step)"
        runners[engine] = functools.partial(run_inferhal, llm)
        # greedy steps take their tokens from lm_head.argmax, which may read and compute less than the head:
        # the bounds leave the head out then (still bounds, looser)
        headless = {"head": False} if getattr(llm.engine.runner, "greedy_head", False) else {}
        if headless:
            no_head.add(engine)
        step_bytes = getattr(llm.engine.loaded.model, "step_weight_bytes", None)
        if step_bytes is not None:
            weight_bytes[engine] = int(step_bytes(**headless))
        product_flops = getattr(llm.engine.loaded.model, "token_product_flops", None)
        if product_flops is not None:
            token_flops[engine] = int(product_flops(**headless))
            rates[engine] = functools.partial(host.product_rate, llm.engine.backend.ops["linear"],
                                              getattr(torch, dtype))
    engines = [e for e, _ in variants]
    cfg.model.dtype = variants[0][1]
    path = str(info.get("path", ""))

    for peer in peers:  # transformers in every dtype inferhal runs in, llama.cpp once
        for engine, dtype in (variants if peer == "transformers" else variants[:1]):
            name = peer + engine[len("inferhal"):] if peer == "transformers" else peer
            try:
                t = time.perf_counter()
                m = peer_loaders(path, torch.get_num_threads(), dtype)[peer]()
            except Exception as exc:  # not installed (llama-cpp-python is an optional extra), or failed to load
                notes[name] = f"not measured: {type(exc).__name__}: {exc}"
                console.print(f"[yellow]{name}: {notes[name]}[/]")
                continue
            load = f"load {time.perf_counter() - t:.1f} s"
            if peer == "transformers":
                notes[name] = f"dtype={dtype}, {load}"
                runners[name] = functools.partial(run_transformers, m, pad_id=0)
            else:
                notes[name] = f"its own GGUF kernels, {load}"
                runners[name] = functools.partial(run_llama_cpp, m, eos_ids=tok.eos_token_ids)
    if int(b.warmup) > 0:
        for run_one in runners.values():
            run_one(prompts[:1], 1, 2)
    repeats = max(1, int(b.repeats))
    rows = measure(runners, prompts, levels, int(b.num_prompts), max_tokens, repeats, console.print,
                   bandwidth=host.read_bandwidth, product_rates=rates)
    add_weight_bounds(rows, weight_bytes)
    add_compute_bounds(rows, token_flops)
    for r in rows:
        if r["engine"] in no_head:
            r["bounds_without_head"] = True
    ratios = speed_ratios(rows, engines)
    table = Table(title=f"e2e: {cfg.model.name}, {max_tokens} greedy tokens per request, median of {repeats} "
                        f"interleaved repeats (×: median of paired ratios)")
    for col in ("engine", "c", "reqs", "tok/s", "TTFT p50 ms", "TTFT p95 ms", "TPOT p50 ms", "TPOT p95 ms",
                "steal %", *(f"{e.replace('inferhal-', '')} ×" for e in engines)):
        table.add_column(col, justify="right" if col != "engine" else "left", no_wrap=col == "engine")
    for r in rows:
        cells = []
        for engine in engines:
            key = ("" if engine == "inferhal" else f"{engine}_") + f"vs_{r['engine']}@{r['concurrency']}"
            cells.append("" if r["engine"] in engines else f"{ratios[key]:.2f}" if key in ratios else "-")
        table.add_row(r["engine"], str(r["concurrency"]), str(r["requests"]), f"{r['tok_s']:.1f}",
                      f"{r['ttft_p50_ms']:.0f}", f"{r['ttft_p95_ms']:.0f}", f"{r['tpot_p50_ms']:.0f}",
                      f"{r['tpot_p95_ms']:.0f}", "-" if r.get("steal") is None else f"{100 * r['steal']:.0f}",
                      *cells)
    console.print(table)
    for k, v in notes.items():
        console.print(f"  {k}: {v}")
    for line in bound_lines(rows):
        console.print(f"  {line}")

    out = str(cfg.output) if cfg.output else os.path.join(str(b.output_dir), "e2e.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    result = {"model": str(cfg.model.name), "max_tokens": max_tokens, "levels": levels, "rows": rows,
              "ratios": ratios, "notes": notes, "repeats": repeats, "torch_threads": torch.get_num_threads(),
              "cpu_count": os.cpu_count(), "load_seconds": info.get("load_seconds"), "stamp": stamp()}
    with open(out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    png = os.path.splitext(out)[0] + ".png"
    _plot(rows, png, str(cfg.model.name))
    console.print(f"wrote {out} and {png}")
    return 0


def _plot(rows: Sequence[dict], path: str, model: str) -> None:
    """tok/s, TTFT p50 and TPOT p50 per engine: lines over concurrency, or bars when one level ran. Each
    inferhal engine's weight-streaming bound (:func:`.bounds.add_weight_bounds`) is drawn dashed on the tok/s panel,
    its product-rate bound (:func:`.bounds.add_compute_bounds`) dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5))
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    levels = sorted({r["concurrency"] for r in rows})
    keys = ("tok_s", "ttft_p50_ms", "tpot_p50_ms")
    colors = {e: f"C{i}" for i, e in enumerate(engines)}
    for eng in engines:
        rs = [r for r in rows if r["engine"] == eng]
        kinds = (("bound_tok_s", "--", "weight-streaming bound"), ("compute_bound_tok_s", ":", "product-rate bound"))
        if len(levels) == 1:
            x = engines.index(eng)
            for ax, key in zip(axes, keys):
                ax.bar(x, rs[0][key], color=colors[eng])
            for key, style, what in kinds:
                if key in rs[0]:
                    axes[0].hlines(rs[0][key], x - 0.4, x + 0.4, colors=colors[eng], linestyles=style,
                                   label=f"{eng}: {what}")
            continue
        cs = [r["concurrency"] for r in rs]
        for ax, key in zip(axes, keys):
            ax.plot(cs, [r[key] for r in rs], marker="o", color=colors[eng], label=eng)
        for key, style, what in kinds:
            bound = [(r["concurrency"], r[key]) for r in rs if key in r]
            if bound:
                axes[0].plot(*zip(*bound), linestyle=style, color=colors[eng], alpha=0.6, label=f"{eng}: {what}")
    for ax, title in zip(axes, ("aggregate output tok/s", "TTFT p50 (ms)", "TPOT p50 (ms)")):
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if len(levels) == 1:
            ax.set_xticks(range(len(engines)), engines, rotation=30, ha="right", fontsize=8)
            ax.set_xlabel(f"concurrency {levels[0]}")
        else:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"inferhal bench e2e: {model}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

