"""Llama family (dense; SmolLM2, TinyLlama, Llama 2/3 GGUFs): the GGUF decoder (:mod:`inferhal.core.models.gguf`)
with Llama's settings (:mod:`.config`) and its file and loader settings (:mod:`.loader`).

``kv_groups_from_config(model_cfg)`` answers ``inferhal plan kv`` from ``model.arch`` or the file's metadata
alone; ``routed_experts_from_config`` is 0 (a dense model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inferhal.core.config.schema import ModelConfig
    from inferhal.core.paging.spec import KVGroupSpec


def kv_groups_from_config(model_cfg: "ModelConfig") -> "list[KVGroupSpec]":
    from inferhal.core.models.gguf.loader import kv_groups_from_config as of_family
    from inferhal.core.models.llama.loader import FAMILY

    return of_family(model_cfg, FAMILY)


def routed_experts_from_config(model_cfg: "ModelConfig") -> int:
    """Llama is dense: no routed experts (so no expert parallelism)."""
    return 0
