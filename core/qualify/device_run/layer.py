"""``layer``: DeepSeek-V4-Flash-sized decode layers under ``torch.profiler``, each op's share of the step.

Two layers at V4-Flash's sizes (hidden 4096, 64 heads on a 512-dim latent, 256 experts top-6 of
intermediate 2048, the 64-head indexer keeping the top 512): one CSA layer (window 128 + indexer top-k over the
4:1 entries) and one HCA layer (128:1), each with its routed MoE, random weights drawn on the device (dense
projections and experts block-quantised as the checkpoint stores them, where the backend's profile takes
those formats), a KV pool laid out as at ``B`` sequences of ``context`` tokens (the pool holds zeros: the
time of a step does not depend on the values), one decode token per sequence. Every op the model calls runs
inside a ``record_function`` named by its op ID, so the profiler's totals say each op's share of the step;
time in no op (the model's own tensor glue) is ``other``. ``reduced`` scale: the same code on the tiny V4's
dimensions.
"""

from __future__ import annotations

import contextlib
from typing import Any

from inferhal.core.qualify.device_run.common import QUICK, Context, bench, error_text, log

#: (batch, contexts) per scale
RUNS = {"full": (64, (16384, 65536)), "reduced": (2, (64, 256))}
BLOCK = 256


class Annotated:
    """An op table whose every call runs inside ``torch.profiler.record_function(op_id)``."""

    def __init__(self, ops: Any) -> None:
        self._ops = ops

    def __getitem__(self, op_id: str):
        import torch

        fn = self._ops[op_id]

        def call(*args, **kwargs):
            with torch.profiler.record_function(op_id):
                return fn(*args, **kwargs)

        return call

    get = __getitem__


def arch(scale: str) -> dict:
    """A two-layer (CSA, HCA) V4 of the Flash config (``full``) or of the tiny one (``reduced``)."""
    from pathlib import Path

    from omegaconf import OmegaConf

    import inferhal.conf

    name = "deepseek_v4_flash" if scale == "full" else "deepseek_v4_tiny"
    raw = OmegaConf.to_container(OmegaConf.load(Path(inferhal.conf.__file__).parent / "model" / f"{name}.yaml").arch)
    raw.update(num_hidden_layers=2, layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
               mlp_layer_types=["moe", "moe"], num_nextn_predict_layers=0)
    if scale == "reduced":
        raw["max_position_embeddings"] = 4096
    return raw


def weights(cfg, dev: str, profile) -> tuple[dict, str]:
    """Random weights on the device in bf16 (tid2eid int64); dense ``*proj.weight`` matrices as FP8 blocks and the
    experts as FP4 groups (else FP8 blocks) where the profile takes them, as the checkpoint stores them."""
    import torch

    from inferhal.core.models.deepseek_v4.loader import finalize
    from inferhal.core.models.deepseek_v4.shapes import expected
    from inferhal.core.ops.quantize import quantize_fp4_group, quantize_fp8_block

    fp8, fp4 = profile.supports("fp8_block_linear"), profile.supports("fp4_grouped_gemm")
    out: dict[str, Any] = {}
    for name, shape in expected(cfg, with_mtp=False).items():
        if name.endswith("tid2eid"):
            out[name] = torch.randint(0, cfg.n_experts, shape, device=dev)
            continue
        if len(shape) == 1 or name.endswith(("scale", "base")):
            out[name] = 1.0 + 0.1 * torch.randn(shape, device=dev)
            continue
        w = torch.randn(shape, device=dev, dtype=torch.bfloat16) * shape[-1] ** -0.5
        if "experts.gate_up_proj" in name or "experts.down_proj" in name:
            w = quantize_fp4_group(w) if fp4 else quantize_fp8_block(w) if fp8 else w
        elif fp8 and name.endswith("proj.weight") and shape[0] % 128 == 0 and shape[1] % 128 == 0:
            w = quantize_fp8_block(w)
        out[name] = w
    kinds = f"dense {'fp8_block' if fp8 else 'bf16'}, experts {'fp4_group' if fp4 else 'fp8_block' if fp8 else 'bf16'}"
    return finalize(out, torch.bfloat16, dev, fp8, fp4), kinds


def decode_batch(model, active, batch: int, context: int, dev: str):
    """A KV pool for ``batch`` sequences of ``context`` tokens and the ForwardBatch of their next token."""
    import torch

    from inferhal.core.models.base import ForwardBatch
    from inferhal.core.paging import planning
    from inferhal.core.paging.batch import SeqSlice, build_attn_batches

    specs = model.kv_groups()
    bs = planning.compatible_block_size(specs, BLOCK)
    nblk = -(-context // bs)
    live = {s.name: (min(nblk, planning.live_blocks(s, bs)) if s.kind == "sliding" else nblk) for s in specs}
    kv = active.kv_storage(planning.storage_request(specs, bs, {k: batch * v for k, v in live.items()}))
    seqs = []
    for b in range(batch):
        ids = {}
        for s in specs:
            own = list(range(b * live[s.name], (b + 1) * live[s.name]))
            ids[s.name] = [-1] * (nblk - live[s.name]) + own  # a sliding group keeps only its last blocks
        seqs.append(SeqSlice(context - 1, 1, ids))
    positions, qsl, attn = build_attn_batches(specs, bs, seqs, dev)
    fb = ForwardBatch(input_ids=torch.randint(0, model.vocab_size, (batch,), device=dev), positions=positions,
                      query_start_loc=qsl, attn=attn, logits_indices=torch.arange(batch, device=dev))
    return fb, kv


def shares(prof, on_device: bool, op_ids) -> tuple[dict, dict, float]:
    """(op -> share of the step's time, op -> ms, total ms) from the profiler's averages: device time on a
    device (the kernels each op launched), host time otherwise."""
    avg = prof.key_averages()

    def t(e, self_=False):
        name = ("self_" if self_ else "") + ("device_time_total" if on_device else "cpu_time_total")
        return float(getattr(e, name, 0.0) or 0.0)

    per = {e.key: t(e) for e in avg if e.key in op_ids}
    if on_device:
        total = sum(t(e, True) for e in avg)
    else:
        total = max((t(e) for e in avg if e.key == "decode_step"), default=sum(per.values()))
    per["other"] = max(0.0, total - sum(per.values()))
    return ({k: v / total for k, v in per.items()} if total else {}), {k: v / 1e3 for k, v in per.items()}, total / 1e3


def layer_rows(ctx: Context, emit) -> None:
    import torch

    from inferhal.core.models.deepseek_v4.config import parse_config
    from inferhal.core.models.deepseek_v4.model import DeepseekV4ForCausalLM
    from inferhal.core.ops.vocabulary import OPS

    active, dev = ctx.active, ctx.dev
    nseq, contexts = RUNS[ctx.scale]
    base = ctx.row("layer", model="V4-Flash sizes, 2 layers (CSA, HCA)" if ctx.scale == "full" else "tiny V4, 2 layers",
                   batch=nseq)
    try:
        cfg = parse_config(arch(ctx.scale))
        w, kinds = weights(cfg, dev, active.profile)
        model = DeepseekV4ForCausalLM(cfg, w, Annotated(active.ops), torch.bfloat16, max(contexts) + 1, dev)
        base["weights"] = kinds
    except Exception as exc:
        emit(dict(base, status="fail", message=error_text(exc, 800)))
        return
    step_fn = getattr(model, "forward_hidden", model.forward)
    for context in contexts:
        row = dict(base, context=context)
        if ctx.late(row, emit):
            continue
        try:
            fb, kv = decode_batch(model, active, nseq, context, dev)
            step = lambda: step_fn(fb, kv)  # noqa: E731
            quick = {} if ctx.on_device else QUICK
            row["ms_per_step"] = bench(step, active.device, **quick)["ms"]
            acts = torch.profiler.supported_activities() if ctx.on_device else [torch.profiler.ProfilerActivity.CPU]
            with torch.profiler.profile(activities=list(acts)) as prof:
                for _ in range(3 if ctx.on_device else 1):
                    with torch.profiler.record_function("decode_step"):
                        step()
                active.device.synchronize()
            share, ms, total = shares(prof, ctx.on_device, set(OPS))
            n = 3 if ctx.on_device else 1
            status = "measured" if ctx.on_device else "dry-run"
            for op, frac in sorted(share.items(), key=lambda kv_: -kv_[1]):
                emit(dict(row, op=op, share=frac, ms_in_op=ms[op] / n, profiled_ms_per_step=total / n, status=status))
            top = sorted(((e.key, float(getattr(e, "self_device_time_total", 0.0) or 0.0)) for e in prof.key_averages()),
                         key=lambda kv_: -kv_[1])[:12]
            emit(dict(row, op="(top kernels)", status=status, kernels={k: v / 1e3 / n for k, v in top if v}))
            log(f"{status:>8} layer ctx{context}: {row['ms_per_step']:.3f} ms/step; "
                + ", ".join(f"{k} {v:.0%}" for k, v in sorted(share.items(), key=lambda kv_: -kv_[1])[:6]))
            del kv, fb
        except Exception as exc:
            emit(dict(row, status="fail", message=error_text(exc, 800)))
        with contextlib.suppress(Exception):
            active.device.synchronize()
