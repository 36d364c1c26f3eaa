"""The paged KV layer groups of DeepSeek-V4 (see :class:`~inferhal.core.paging.spec.KVGroupSpec`).

=================  ==========  =====================  ================================  =====================
group              kind        tokens per slot        slot (one layer)                  layers
=================  ==========  =====================  ================================  =====================
``swa``            sliding     1 (window n_win)       latent K=V ``(head_dim,)``        every layer + MTP
``csa``            compressed  CSA ratio m            compressed entry ``(head_dim,)``  CSA layers
``csa_index``      compressed  m                      indexer key ``(index_head_dim,)`` CSA layers
``csa_state``      sliding     1 (window 2m)          ``(2, 2*head_dim)`` kv; gate      CSA layers
``csa_index_state`` sliding    1 (window 2m)          ``(2, 2*index_head_dim)``         CSA layers
``hca``            compressed  HCA ratio m'           ``(head_dim,)``                   HCA layers
``hca_state``      sliding     1 (window m')          ``(2, head_dim)`` kv; gate        HCA layers
=================  ==========  =====================  ================================  =====================

With cross-layer KV sharing (``kv_sources``), "CSA layers" and "HCA layers" above are the source layers only.

The state groups hold each token's compressor projections (kv and gate, before the position bias) until
the window that needs them has closed: CSA windows overlap (entry ``e`` pools tokens ``[(e-1)m, (e+1)m)``),
so they keep ``2m`` tokens; HCA keeps ``m'``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from inferhal.core.errors import UserError
from inferhal.core.models.deepseek_v4.config import CSA, HCA, V4Config, parse_config
from inferhal.core.paging import formats
from inferhal.core.paging.spec import KVGroupSpec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise UserError(f"model.dtype={name!r} is not supported by deepseek_v4; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def v4_config(model_cfg: Any) -> V4Config:
    """The :class:`V4Config` of a ``model`` config: ``arch`` for format=random, else ``path``/config.json."""
    if getattr(model_cfg, "format", "hf") == "random":
        return parse_config(dict(model_cfg.arch or {}))
    path = getattr(model_cfg, "path", None)
    if not path:
        if model_cfg.arch:
            return parse_config(dict(model_cfg.arch))
        raise UserError(f"model {model_cfg.name!r}: format={model_cfg.format!r} needs model.path (an HF directory)")
    cj = os.path.join(path, "config.json")
    if not os.path.isfile(cj):
        raise UserError(f"model.path={path!r} has no config.json")
    try:
        with open(cj) as f:
            raw = json.load(f)
    except ValueError as exc:
        raise UserError(f"{cj} is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise UserError(f"{cj} holds a {type(raw).__name__}, not a JSON object of model settings")
    return parse_config(raw)


def record_formats(cfg: V4Config, kv_dtype: str = "auto") -> dict[str, formats.KVFormat | None]:
    """The record format of the ``main`` entries (window latents and compressed entries: ``head_dim``
    channels, the last ``rope_dim`` rotary) and of the ``index`` entries (indexer keys) in ``kv_dtype``;
    None for ``auto`` (values in the model's dtype)."""
    if kv_dtype not in formats.KV_DTYPES:
        raise UserError(f"cache.kv_dtype must be one of {', '.join(formats.KV_DTYPES)}, got {kv_dtype!r}")
    if kv_dtype == "auto":
        return {"main": None, "index": None}
    return {"main": formats.record(kv_dtype, cfg.head_dim, cfg.rope_dim, role="main"),
            "index": formats.record(kv_dtype, cfg.index_head_dim, role="index")}


def kv_groups(cfg: V4Config, dtype: torch.dtype = torch.float32, kv_dtype: str = "auto") -> list[KVGroupSpec]:
    """The groups of ``cfg``; with cross-layer sharing (``kv_sources``) the compressed groups and their
    compressor state hold only the source layers (the layers that read another's KV write none).
    ``kv_dtype`` (:mod:`inferhal.core.paging.formats`): the window, compressed and indexer-key groups as
    quantised records (uint8 slots of one record each); the compressor state stays in the model's dtype."""
    csa = tuple(i for i, t in enumerate(cfg.layer_types) if t == CSA and cfg.kv_source(i) == i)
    hca = tuple(i for i, t in enumerate(cfg.layer_types) if t == HCA and cfg.kv_source(i) == i)
    every = tuple(range(cfg.num_layers + cfg.num_mtp))

    recs = record_formats(cfg, kv_dtype)

    def entry(dims: int, role: str) -> dict:
        rec = recs[role]
        if rec is None:
            return {"slot_shape": (dims,), "dtype": dtype}
        return {"slot_shape": (rec.nbytes,), "dtype": torch.uint8, "record": rec.layout}

    main, index = entry(cfg.head_dim, "main"), entry(cfg.index_head_dim, "index")
    out = [KVGroupSpec("swa", "sliding", every, window=cfg.sliding_window, **main)]
    if csa:
        m = cfg.compress_rates[CSA]
        out += [
            KVGroupSpec("csa", "compressed", csa, tokens_per_slot=m, **main),
            KVGroupSpec("csa_index", "compressed", csa, tokens_per_slot=m, **index),
            KVGroupSpec("csa_state", "sliding", csa, (2, 2 * cfg.head_dim), dtype, window=2 * m),
            KVGroupSpec("csa_index_state", "sliding", csa, (2, 2 * cfg.index_head_dim), dtype, window=2 * m),
        ]
    if hca:
        m = cfg.compress_rates[HCA]
        out += [
            KVGroupSpec("hca", "compressed", hca, tokens_per_slot=m, **main),
            KVGroupSpec("hca_state", "sliding", hca, (2, cfg.head_dim), dtype, window=m),
        ]
    return out


def kv_groups_from_config(model_cfg: Any, kv_dtype: str = "auto") -> list[KVGroupSpec]:
    """KV groups of a ``model`` config without loading weights (``inferhal plan kv``)."""
    return kv_groups(v4_config(model_cfg), torch_dtype(getattr(model_cfg, "dtype", "float32")), kv_dtype)
