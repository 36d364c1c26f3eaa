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
}


def load_model(model_cfg: "ModelConfig", backend: "ActiveBackend") -> "LoadedModel":
    if model_cfg.family not in FAMILIES:
        raise UserError(f"unknown model family {model_cfg.family!r}; known: {', '.join(FAMILIES)}")
    mod, fn = FAMILIES[model_cfg.family].split(":")
    return getattr(importlib.import_module(mod), fn)(model_cfg, backend)
