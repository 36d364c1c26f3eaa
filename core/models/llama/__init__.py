"""Llama family (dense; SmolLM2, TinyLlama, Llama 2/3 GGUFs): model against op IDs (:mod:`.model`),
config from GGUF metadata (:mod:`.config`), loader (:mod:`.loader`; the GGUF reader and dequantiser are
Gemma 3's), byte-level BPE tokenizer and sandboxed chat template (:mod:`.tokenizer`).

``kv_groups_from_config(model_cfg)`` answers ``inferhal plan kv`` from the file's metadata alone;
``routed_experts_from_config`` is 0 (a dense model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inferhal.core.config.schema import ModelConfig
    from inferhal.core.paging.spec import KVGroupSpec


def kv_groups_from_config(model_cfg: "ModelConfig") -> "list[KVGroupSpec]":
    from inferhal.core.models.gemma3.gguf_file import GGUFFile
    from inferhal.core.models.llama.loader import DTYPES, config_of, resolve_path
    from inferhal.core.models.llama.model import kv_groups_for

    cfg = config_of(GGUFFile(resolve_path(model_cfg)))
    return kv_groups_for(cfg, DTYPES.get(str(model_cfg.dtype), DTYPES["float32"]))


def routed_experts_from_config(model_cfg: "ModelConfig") -> int:
    """Llama is dense: no routed experts (so no expert parallelism)."""
    return 0
