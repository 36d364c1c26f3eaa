"""inferhal: an inference engine for DeepSeek-V4-family MoE models behind one backend contract.

The repository root is this package: ``inferhal.core`` (device-agnostic engine, ``core/``),
``inferhal.backends`` (pluggy backends, ``backends/``), ``inferhal.kernels`` (device kernels,
``kernels/``) and ``inferhal.conf`` (the Hydra config tree, ``conf/``).

``from inferhal import LLM, SamplingParams`` is the offline API; it is imported lazily so that
``import inferhal.core`` stays free of any engine or device import.
"""

__version__ = "0.1.0"

_LAZY = {
    "LLM": "inferhal.core.engine.llm",
    "SamplingParams": "inferhal.core.sampling.params",
    "RequestOutput": "inferhal.core.engine.outputs",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'inferhal' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "RequestOutput", "__version__"]
