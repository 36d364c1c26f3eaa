"""``model.family`` → loader. A loader is ``load(model_cfg: ModelConfig, backend: ActiveBackend) -> LoadedModel``."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from inferhal.core.errors import UserError

if TYPE_CHECKING:
    from inferhal.core.config.schema import ModelConfig
    from inferhal.core.models.base import LoadedModel
    from inferhal.core.registry import ActiveBackend

FAMILIES = {
    "gemma3": "inferhal.core.models.gemma3.loader:load",
    "deepseek_v4": "inferhal.core.models.deepseek_v4.loader:load",
    "llama": "inferhal.core.models.llama.loader:load",
}


def load_model(model_cfg: "ModelConfig", backend: "ActiveBackend") -> "LoadedModel":
    if model_cfg.family not in FAMILIES:
        raise UserError(f"unknown model family {model_cfg.family!r}; known: {', '.join(FAMILIES)}")
    mod, fn = FAMILIES[model_cfg.family].split(":")
    return getattr(importlib.import_module(mod), fn)(model_cfg, backend)


def kv_dtypes(model_cfg: "ModelConfig") -> tuple[str, ...]:
    """The ``cache.kv_dtype`` values the family of ``model_cfg`` stores, without loading it (the family
    package's ``KV_DTYPES``; ``auto`` only when it has none)."""
    if model_cfg.family not in FAMILIES:
        raise UserError(f"unknown model family {model_cfg.family!r}; known: {', '.join(FAMILIES)}")
    return tuple(getattr(importlib.import_module(f"inferhal.core.models.{model_cfg.family}"), "KV_DTYPES", ("auto",)))


def routed_experts(model_cfg: "ModelConfig") -> int | None:
    """Routed experts per MoE layer of ``model_cfg``, read from its config alone (no weights): 0 for a
    dense model, None when its family cannot tell without loading. A family answers through
    ``routed_experts_from_config(model_cfg)`` in its package (as ``kv_groups_from_config`` answers
    ``inferhal plan kv``)."""
    if model_cfg.family not in FAMILIES:
        raise UserError(f"unknown model family {model_cfg.family!r}; known: {', '.join(FAMILIES)}")
    fn = getattr(importlib.import_module(f"inferhal.core.models.{model_cfg.family}"), "routed_experts_from_config", None)
    return None if fn is None else int(fn(model_cfg))
