import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "gemma3"))  # gemma_fixtures.py

from gemma_fixtures import gguf_path  # noqa: E402


@pytest.fixture(scope="module")
def gemma_path() -> str:
    """The real Gemma 3 270M GGUF (read here, never loaded whole): it holds F32, Q8_0, Q5_0, Q4_K and Q6_K tensors."""
    return gguf_path()
