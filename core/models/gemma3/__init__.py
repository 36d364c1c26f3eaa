"""Gemma 3 (text): model against op IDs (:mod:`.model`), GGUF reader and loader (:mod:`.gguf_file`,
:mod:`.dequant`, :mod:`.loader`), tokenizer rebuilt from GGUF metadata (:mod:`.tokenizer`), chat
format (:mod:`.chat`).

``kv_groups_from_config(model_cfg)`` answers ``inferhal plan kv`` from the file's metadata alone,
without dequantising any weight; ``routed_experts_from_config`` is 0 (a dense model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inferhal.core.config.schema import ModelConfig
    from inferhal.core.paging.spec import KVGroupSpec


def kv_groups_from_config(model_cfg: "ModelConfig") -> "list[KVGroupSpec]":
    from inferhal.core.models.gemma3.config import Gemma3Config, from_gguf_metadata
    from inferhal.core.models.gemma3.gguf_file import GGUFFile
    from inferhal.core.models.gemma3.loader import DTYPES, resolve_path
    from inferhal.core.models.gemma3.model import kv_groups_for

    if model_cfg.arch:
        cfg = Gemma3Config.from_mapping(dict(model_cfg.arch))
    else:
        path = resolve_path(model_cfg)
        cfg = from_gguf_metadata(GGUFFile(path).metadata, where=str(path))
    return kv_groups_for(cfg, DTYPES.get(str(model_cfg.dtype), DTYPES["float32"]))


def routed_experts_from_config(model_cfg: "ModelConfig") -> int:
    """Gemma 3 is dense: no routed experts (so no expert parallelism)."""
    return 0
