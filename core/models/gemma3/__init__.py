"""Gemma 3 (text): the GGUF decoder (:mod:`inferhal.core.models.gguf`) with Gemma 3's settings
(:mod:`.config`), its file and loader settings (:mod:`.loader`) and its built-in chat format (:mod:`.chat`).

``kv_groups_from_config(model_cfg)`` answers ``inferhal plan kv`` from ``model.arch`` or the file's metadata
alone, without dequantising any weight; ``routed_experts_from_config`` is 0 (a dense model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inferhal.core.config.schema import ModelConfig
    from inferhal.core.paging.spec import KVGroupSpec


def kv_groups_from_config(model_cfg: "ModelConfig") -> "list[KVGroupSpec]":
    from inferhal.core.models.gemma3.loader import FAMILY
    from inferhal.core.models.gguf.loader import kv_groups_from_config as of_family

    return of_family(model_cfg, FAMILY)


def routed_experts_from_config(model_cfg: "ModelConfig") -> int:
    """Gemma 3 is dense: no routed experts (so no expert parallelism)."""
    return 0
