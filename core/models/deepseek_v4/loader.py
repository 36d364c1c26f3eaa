"""``load(model_cfg, backend) -> LoadedModel`` for DeepSeek-V4 (registered as family ``deepseek_v4``).

``model.format``:
- ``hf``: ``model.path`` is a directory with ``config.json`` and ``*.safetensors`` (a
  ``model.safetensors.index.json`` is honoured). Names may be transformers' or DeepSeek's official ones
  (:mod:`.names`); per-expert ``w1/w2/w3`` are stacked. FP8 block-scaled and FP4 group-scaled weights stay
  quantised (:class:`QuantWeight`) when the backend profile supports ``fp8_block_linear`` /
  ``fp4_grouped_gemm``, else they are dequantised here. Every tensor of :func:`.shapes.expected` must be
  present with its shape; anything missing, extra or mis-shaped is a UserError naming the tensor. MTP
  weights (``mtp.*``) are optional as a whole (transformers' ``save_pretrained`` drops them).
- ``random``: weights drawn from ``model.seed`` for ``model.arch`` (transformers' config names).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any

import torch

from inferhal.core.config.context import model_len
from inferhal.core.errors import UserError
from inferhal.core.models.base import LoadedModel
from inferhal.core.models.deepseek_v4.kv import torch_dtype, v4_config
from inferhal.core.models.deepseek_v4.make_checkpoint import random_tensors
from inferhal.core.models.deepseek_v4.model import DeepseekV4ForCausalLM
from inferhal.core.models.deepseek_v4.names import canonical, split_expert
from inferhal.core.models.deepseek_v4.quantized import make_quant
from inferhal.core.ops.quantize import dequantize
from inferhal.core.models.deepseek_v4.shapes import expected, keep_fp32
from inferhal.core.models.deepseek_v4.tokenizer import load_tokenizer
from inferhal.core.ops.quant import QuantWeight


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, by their stored names."""
    from safetensors import SafetensorError, safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # not JSON, or no {"weight_map": {...}}
            raise UserError(f"{index} is not a safetensors index ({{\"weight_map\": {{tensor: shard}}}}): "
                            f"{type(exc).__name__}: {exc}") from None
        files = [os.path.join(path, f) for f in files]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise UserError(f"{index} names shard {os.path.basename(missing[0])!r}, which does not exist")
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise UserError(f"model.path={path!r} holds no *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for fname in files:
        try:
            with safe_open(fname, framework="pt") as f:
                for k in f.keys():
                    if k in out:
                        raise UserError(f"checkpoint tensor {k!r} appears in two shards (second: "
                                        f"{os.path.basename(fname)})")
                    out[k] = f.get_tensor(k)
        except (SafetensorError, OSError) as exc:  # truncated, corrupt or unreadable
            raise UserError(f"{fname} is not a readable safetensors file: {exc}") from None
    return out


def _block_size(raw_cfg: dict) -> tuple[int, int]:
    qc = raw_cfg.get("quantization_config") or {}
    b = qc.get("weight_block_size") or (128, 128)
    return int(b[0]), int(b[1])


def assemble(stored: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], block: tuple[int, int]) -> dict[str, Any]:
    """Stored tensors → canonical name → tensor | QuantWeight (experts stacked, scales paired)."""
    canon: dict[str, torch.Tensor] = {}
    for k, t in stored.items():
        c = canonical(k)
        if c in canon:
            raise UserError(f"checkpoint tensors {k!r} and another both map to {c!r}")
        canon[c] = t
    experts: dict[tuple[str, str], dict[int, Any]] = {}
    out: dict[str, Any] = {}
    for name, t in canon.items():
        if name.endswith("_scale_inv"):
            base = name[: -len("_scale_inv")]
            if base not in canon:
                raise UserError(f"checkpoint tensor {name!r} is a scale without its weight {base!r}")
            continue
        ex = split_expert(name)
        scale = canon.get(name + "_scale_inv")  # X.weight_scale_inv, or experts.gate_up_proj_scale_inv
        if ex is not None:
            stem, e, part, _ = ex
            experts.setdefault((stem, part), {})[e] = (name, t, scale)
            continue
        if scale is not None:
            if name not in shapes:
                raise UserError(f"unexpected checkpoint tensor {name!r}")
            out[name] = make_quant(name, t, scale, shapes[name], block)
        else:
            out[name] = t
    for (stem, part), per in experts.items():
        n_e = max(per) + 1
        if sorted(per) != list(range(n_e)):
            raise UserError(f"checkpoint tensors {stem}.E.{part}: expert ids {sorted(per)} are not 0..{n_e - 1}")
        ws = []
        for e in range(n_e):
            name, t, scale = per[e]
            if scale is None:
                ws.append(t)
                continue
            k = t.shape[-1] * (2 if t.dtype in (torch.int8, torch.uint8) else 1)
            ws.append(make_quant(name, t, scale, (t.shape[0], k), block))
        out[f"{stem}.{part}"] = ws
    for stem in {s for s, _ in experts}:
        parts = {p: out.pop(f"{stem}.{p}", None) for p in ("w1", "w2", "w3")}
        if any(v is None for v in parts.values()):
            raise UserError(f"checkpoint tensors {stem}.E.w1/w2/w3: "
                            f"missing {[p for p, v in parts.items() if v is None]}")
        if len({len(v) for v in parts.values()}) != 1:
            raise UserError(f"checkpoint tensors {stem}.E.w1/w2/w3: different expert counts")
        out[stem + ".gate_up_proj"] = _stack([_cat2(a, b) for a, b in zip(parts["w1"], parts["w3"])])
        out[stem + ".down_proj"] = _stack(parts["w2"])
    return out


def _cat2(a: Any, b: Any) -> Any:
    if isinstance(a, QuantWeight) and isinstance(b, QuantWeight) and (a.format == "fp4_group" or a.shape[0] % a.block[0] == 0):
        return QuantWeight(torch.cat((a.data, b.data)), torch.cat((a.scale, b.scale)), a.format,
                           (a.shape[0] + b.shape[0], a.shape[1]), a.block)
    return torch.cat((dequantize(a), dequantize(b)))


def _stack(ws: list) -> Any:
    if all(isinstance(w, QuantWeight) for w in ws) and len({(w.format, w.shape, w.block) for w in ws}) == 1:
        w0 = ws[0]
        return QuantWeight(torch.stack([w.data for w in ws]), torch.stack([w.scale for w in ws]), w0.format,
                           (len(ws), *w0.shape), w0.block)
    return torch.stack([dequantize(w) for w in ws])


def validate(weights: dict[str, Any], cfg: Any) -> bool:
    """Check names and shapes; returns whether MTP weights are present (all or none)."""
    main = expected(cfg, with_mtp=False)
    mtp = {k: v for k, v in expected(cfg).items() if k not in main}
    has_mtp = any(k.startswith("mtp.") for k in weights)
    want = {**main, **(mtp if has_mtp else {})}
    for name in sorted(want):
        if name not in weights:
            why = " (MTP weights are all-or-none)" if name.startswith("mtp.") else ""
            raise UserError(f"checkpoint is missing tensor {name!r}{why}")
    for name in sorted(weights):
        if name not in want:
            raise UserError(f"unexpected checkpoint tensor {name!r} (not part of this DeepSeek-V4 config)")
        got = tuple(weights[name].shape)
        if got != tuple(want[name]):
            raise UserError(f"checkpoint tensor {name!r} has shape {got}, expected {tuple(want[name])}")
    return has_mtp


def finalize(weights: dict[str, Any], dtype: torch.dtype, device: str, fp8_ok: bool, fp4_ok: bool) -> dict[str, Any]:
    """dtype / device / quantisation policy: consumers of ``linear``/``moe.experts`` may stay quantised."""
    out: dict[str, Any] = {}
    for name, w in weights.items():
        if isinstance(w, QuantWeight):
            keep = fp4_ok if w.format == "fp4_group" else fp8_ok
            if keep and name not in ("embed_tokens.weight",):
                out[name] = QuantWeight(w.data.to(device), w.scale.to(device), w.format, w.shape, w.block)
                continue
            w = dequantize(w)
        if name.endswith("tid2eid"):
            out[name] = w.to(device=device, dtype=torch.long)
        elif keep_fp32(name):
            out[name] = w.to(device=device, dtype=torch.float32)
        else:
            out[name] = w.to(device=device, dtype=dtype)
    return out


def load(model_cfg: Any, backend: Any) -> LoadedModel:
    cfg = v4_config(model_cfg)
    dtype = torch_dtype(model_cfg.dtype)
    device = getattr(backend.profile, "torch_device", "cpu")
    shapes = expected(cfg)
    if model_cfg.format == "random":
        weights: dict[str, Any] = dict(random_tensors(cfg, int(model_cfg.seed)))
        path = None
    elif model_cfg.format == "hf":
        path = model_cfg.path
        if not path or not os.path.isdir(path):
            raise UserError(f"model {model_cfg.name!r}: model.path={path!r} is not a directory")
        weights = assemble(read_safetensors(path), shapes, _block_size(dict(cfg.raw)))
    else:
        raise UserError(f"model {model_cfg.name!r}: deepseek_v4 loads format hf or random, not {model_cfg.format!r}")
    has_mtp = validate(weights, cfg)
    prof = backend.profile
    weights = finalize(weights, dtype, device, prof.supports("fp8_block_linear"), prof.supports("fp4_grouped_gemm"))
    trained = cfg.max_position_embeddings
    max_len = model_len(model_cfg, trained)
    if max_len > trained:  # model.allow_long_context: rotary tables for every position up to max_model_len
        cfg = dataclasses.replace(cfg, max_position_embeddings=max_len)
    model = DeepseekV4ForCausalLM(cfg, weights, backend.ops, dtype, max_len, device, has_mtp)
    if getattr(model_cfg, "mtp_weights", None):
        load_mtp_overlay(model, model_cfg)
    tok = load_tokenizer(path, cfg, getattr(model_cfg, "chat_template", None)) if path else None
    quant = sorted({w.format for w in weights.values() if isinstance(w, QuantWeight)})
    return LoadedModel(model=model, tokenizer=tok, name=model_cfg.name, family="deepseek_v4",
                       info={"num_layers": cfg.num_layers, "mtp_layers": model.num_mtp_layers, "quantized": quant,
                             "dtype": str(dtype).replace("torch.", ""), "path": path}, max_context=trained)


def load_mtp_overlay(model: Any, model_cfg: Any) -> None:
    """Lay ``model.mtp_weights`` (``mtp.*`` tensors, e.g. from ``fit_mtp``) over the model's MTP layers."""
    import inferhal

    path = str(model_cfg.mtp_weights)
    if not os.path.isabs(path) and not os.path.exists(path):
        path = os.path.join(os.path.dirname(os.path.abspath(inferhal.__file__)), path)
    if not os.path.isfile(path):
        raise UserError(f"model {model_cfg.name!r}: model.mtp_weights={model_cfg.mtp_weights!r} is not a file")
    if model.num_mtp_layers < 1:
        raise UserError(f"model {model_cfg.name!r}: model.mtp_weights is set but the model has no MTP layers")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(path)
    except (SafetensorError, OSError) as exc:
        raise UserError(f"model {model_cfg.name!r}: model.mtp_weights={path!r} is not a readable safetensors file: "
                        f"{exc}") from None
    try:
        model.load_mtp_weights(tensors)
    except ValueError as exc:
        raise UserError(f"model {model_cfg.name!r}: model.mtp_weights={model_cfg.mtp_weights!r}: {exc}") from None
