"""``inferhal bench kv_fidelity``: what FP8 and FP4 KV records (``cache.kv_dtype``) cost in accuracy and in
step time, against the model's own dtype (``auto``), on tiny random DeepSeek-V4 configs in fp32 compute on the
selected backend (reference by default).

- Logits error, teacher-forced: each prompt plus its ``auto`` greedy continuation runs as one prefill with
  every position's logits (the prefill's attention reads the quantised records it has just written), compared
  with ``auto``'s: max |error| over the logits' standard deviation, relative L2 error, top-1 agreement.
- Greedy agreement: ``bench.max_tokens`` (32) greedy tokens per prompt through the engine (paging, prefix
  cache, decode): tokens equal to ``auto``'s before the first difference, and prompts that match in full.
  Random tiny models have small logit margins, so this is a harsh measure; trained models have larger ones.
- Step time: the same greedy batch (all prompts at once) timed per KV dtype, median of ``bench.repeats``,
  as a ratio to ``auto`` within one run.

Configs: ``deepseek_v4_tiny`` (head_dim 32, 8 RoPE dims: the FP8 record has one 24-channel block) and the
same with head_dim 128 / index_head_dim 64 (``wide``: FP8 records of two 64-channel blocks, as V4's 448 NoPE
channels are seven). Table and JSON under ``bench.output_dir`` (or ``output=``).
"""

from __future__ import annotations

import statistics
import time

import torch

from inferhal.core.bench import write_json

KV_DTYPES = ("auto", "fp8", "fp4")
PROMPTS, PROMPT_LEN = 8, 48
CONFIGS = {"tiny": {}, "wide": {"head_dim": 128, "index_head_dim": 64, "partial_rotary_factor": 0.25}}


def _teacher_forced(model, backend, ids: list[int]) -> torch.Tensor:
    """fp32 logits of every position of ``ids``, one prefill on fresh pages."""
    from inferhal.core.models.base import ForwardBatch
    from inferhal.core.paging import planning
    from inferhal.core.paging.batch import SeqSlice, build_attn_batches

    specs = list(model.kv_groups())
    bs = planning.compatible_block_size(specs, 16)
    nb = -(-len(ids) // bs) + 1
    kv = backend.kv_storage(planning.storage_request(specs, bs, nb))
    seq = SeqSlice(0, len(ids), {s.name: list(range(nb)) for s in specs})
    pos, qsl, attn = build_attn_batches(specs, bs, [seq])
    batch = ForwardBatch(torch.tensor(ids), pos, qsl, attn, torch.arange(len(ids)))
    return model.forward(batch, kv)


def measure(name: str, arch: dict, backend_name: str, max_tokens: int, repeats: int, progress=print) -> list[dict]:
    from inferhal import LLM, SamplingParams

    g = torch.Generator().manual_seed(7)
    vocab = 192  # deepseek_v4_tiny's
    prompts = [torch.randint(1, vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(PROMPTS)]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    rows, ref_tokens, ref_logits = [], None, None
    for kd in KV_DTYPES:
        llm = LLM("deepseek_v4_tiny", backend_name, kv_dtype=kd, overrides=_arch_overrides(arch))
        times = []
        for _ in range(max(1, repeats)):
            llm.engine.kv_manager.reset_prefix_cache()  # every repeat computes its prompts
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp)
            times.append(time.perf_counter() - t0)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        if ref_tokens is None:
            ref_tokens = tokens
        logits = torch.cat([_teacher_forced(llm.engine.model, llm.engine.backend, p + t) for p, t in zip(prompts, ref_tokens)])
        if ref_logits is None:
            ref_logits = logits
        err = (logits - ref_logits).abs()
        agree = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), len(r)) for t, r in zip(tokens, ref_tokens)]
        rows.append({
            "config": name, "kv_dtype": kd,
            "kv_bytes_per_token": sum(s.bytes_per_token() for s in llm.engine.specs if s.kind == "compressed"),
            "window_bytes_per_token": sum(s.bytes_per_token() for s in llm.engine.specs if s.name == "swa"),
            "max_err_over_std": float(err.max() / ref_logits.std()),
            "rel_l2": float((logits - ref_logits).norm() / ref_logits.norm()),
            "top1_agree": float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
            "greedy_prefix_mean": statistics.mean(agree), "greedy_full": sum(a == max_tokens for a in agree),
            "prompts": len(prompts), "max_tokens": max_tokens, "step_s_median": statistics.median(times),
        })
        progress(f"[kv_fidelity] {name} {kd}: rel_l2 {rows[-1]['rel_l2']:.2e}, greedy {rows[-1]['greedy_full']}/"
                 f"{len(prompts)} in full, {statistics.median(times):.2f} s")
    for r in rows:
        r["time_vs_auto"] = r["step_s_median"] / rows[0]["step_s_median"]
    return rows


def _arch_overrides(arch: dict) -> list[str]:
    return [f"model.arch.{k}={v}" for k, v in arch.items()]


def run(cfg) -> int:
    from rich.table import Table

    from inferhal.core.console import console as make_console

    console = make_console(min_width=140)
    rows = []
    for name, arch in CONFIGS.items():
        rows += measure(name, arch, cfg.backend.name, int(cfg.bench.max_tokens), int(cfg.bench.repeats),
                        progress=lambda s: console.print(s, highlight=False))
    table = Table(title=f"KV records vs the model dtype: tiny DeepSeek-V4, fp32 compute, backend {cfg.backend.name}")
    for col in ("config", "kv_dtype", "KV B/token", "window B/token", "max|err|/std", "rel L2", "top-1",
                f"greedy prefix /{rows[0]['max_tokens']}", "full", "time vs auto"):
        table.add_column(col, justify="left" if col in ("config", "kv_dtype") else "right")
    for r in rows:
        table.add_row(r["config"], r["kv_dtype"], f"{r['kv_bytes_per_token']:.1f}", f"{r['window_bytes_per_token']:.0f}",
                      f"{r['max_err_over_std']:.3f}", f"{r['rel_l2']:.2e}", f"{100 * r['top1_agree']:.1f}%",
                      f"{r['greedy_prefix_mean']:.1f}", f"{r['greedy_full']}/{r['prompts']}", f"{r['time_vs_auto']:.2f}x")
    console.print(table)
    path = write_json(cfg, "kv_fidelity.json",
                      {"rows": rows, "note": "step time: one loaded 2-core host, ratios within one run"})
    console.print(f"wrote {path}", highlight=False)
    return 0
