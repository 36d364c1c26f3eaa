"""``model.max_model_len`` against the context the model was trained for: one rule, checked where the context
is first known.

- At compose, when the config itself declares it (``model.arch.max_position_embeddings``: the DeepSeek-V4
  configs, random or planned from ``arch``): :func:`at_compose`.
- At load, when only the checkpoint does (a GGUF's ``context_length``, a ``config.json``'s
  ``max_position_embeddings``): the loader builds the model for :func:`model_len` positions and reports the
  declared context as ``LoadedModel.max_context``; the LLM builder then calls :func:`check_loaded`.

Beyond that context the model's positions were never trained, so a longer ``max_model_len`` is refused unless
``model.allow_long_context=true`` says to run past it (vLLM's ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is the same
switch): then the loaders build rotary tables for every position up to ``max_model_len`` and the engine serves
them.
"""

from __future__ import annotations

from typing import Any, Optional

from inferhal.core.config.errors import ConfigError

#: model family → where its checkpoint declares its context (for the message)
SOURCES = {"gemma3": "its GGUF's context_length", "llama": "its GGUF's context_length",
           "deepseek_v4": "its config's max_position_embeddings"}


def refusal(max_model_len: int, context: int, model: str, source: str) -> str:
    return (f"model.max_model_len={max_model_len} is beyond the context model {model!r} was trained for: "
            f"{context} tokens ({source}). Set model.max_model_len <= {context}, or model.allow_long_context=true "
            f"to run past it (positions the model never saw in training: its output there is not defined)")


def allowed(model_cfg: Any) -> bool:
    return bool(getattr(model_cfg, "allow_long_context", False))


def model_len(model_cfg: Any, context: int) -> int:
    """The positions a loader builds the model for: ``model.max_model_len``, capped at the model's own
    ``context`` unless ``model.allow_long_context`` (then all of them)."""
    n = int(model_cfg.max_model_len)
    return n if allowed(model_cfg) else min(n, int(context))


def at_compose(cfg: Any) -> list[tuple[str, str]]:
    """``[("model.max_model_len", message)]`` when the config declares the model's context and the length is past
    it without ``model.allow_long_context``."""
    from omegaconf import OmegaConf

    n = OmegaConf.select(cfg, "model.max_model_len", default=None)
    context = OmegaConf.select(cfg, "model.arch.max_position_embeddings", default=None)
    if n is None or context is None or allowed(cfg.model) or int(n) <= int(context):
        return []
    name = OmegaConf.select(cfg, "model.name", default="?", throw_on_missing=False)
    return [("model.max_model_len", refusal(int(n), int(context), str(name), "model.arch.max_position_embeddings"))]


def check_loaded(model_cfg: Any, loaded: Any) -> None:
    """Refuse ``model.max_model_len`` past the context a loaded model declares (``loaded.max_context``; a
    model that declares none is not checked), with :func:`at_compose`'s message."""
    context: Optional[int] = getattr(loaded, "max_context", None)
    n = int(model_cfg.max_model_len)
    if context is None or allowed(model_cfg) or n <= int(context):
        return
    family = str(getattr(model_cfg, "family", ""))
    raise ConfigError(refusal(n, int(context), str(model_cfg.name), SOURCES.get(family, "the context it declares")))
