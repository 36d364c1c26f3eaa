"""The base of the GGUF decoder families (Gemma 3, Llama): what every family reads from a GGUF file the same
way. The reader (:mod:`.reader`), the dequantiser (:mod:`.dequant`), the disk cache of dequantised weights
(:mod:`.weight_cache`), the tokenizers rebuilt from the file's vocabulary (:mod:`.tokenizer`), the chat
template (:mod:`.chat`), one dense decoder configured by data (:mod:`.config`, :mod:`.decoder`) and the loader a
family calls with its own settings (:mod:`.loader`). A family package (``models/gemma3``, ``models/llama``)
holds only what is its own: its defaults and metadata keys, where its file comes from, its chat format.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where dequantised weights (``weights/``) and rebuilt tokenizers (``tokenizers/``) are kept:
    ``$INFERHAL_CACHE``, else ``~/.cache/inferhal``."""
    return Path(os.environ.get("INFERHAL_CACHE", Path.home() / ".cache" / "inferhal"))
