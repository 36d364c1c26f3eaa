"""Composing the root config: the conf/ tree, the user's overrides and keyword updates, checked in one place
(:mod:`inferhal.core.config.refusals`), for the CLI, ``LLM(...)`` and every tool that builds a config."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from inferhal.core.config import refusals
from inferhal.core.config.errors import ConfigError, explain
from inferhal.core.config.schema import register_schemas

CONF_MODULE = "inferhal.conf"


def compose(overrides: Sequence[str] = (), command: str = "config", updates: Mapping[str, Any] | None = None,
            check: bool = True):
    """Compose the root config with ``overrides`` (raises ConfigError with a clear message).

    ``updates``: dotted path → value, set after composition (the Python API's keyword options, whose
    values need not be Hydra override strings). ``command``: the command words (``"plan kv"``; ``"LLM"`` for
    the Python API), which decide the fields it reads (:mod:`inferhal.core.config.reads`). ``check``: refuse
    every field the command does not read and every value this build cannot honour
    (:mod:`inferhal.core.config.refusals`); this is the one place that check runs for the CLI and for
    ``LLM(...)``. Only tests that inspect a shipped config file turn it off.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    register_schemas()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONF_MODULE, version_base=None):
            cfg = hydra_compose(config_name="config", overrides=[*overrides, f"command='{command}'"])
            if check and not _DEFAULTS:
                _DEFAULTS.append(hydra_compose(config_name="config"))
    except Exception as exc:
        raise ConfigError(explain(exc, overrides)) from exc
    finally:
        GlobalHydra.instance().clear()
    for path, value in (updates or {}).items():
        try:
            OmegaConf.update(cfg, path, value, merge=False)
        except Exception as exc:  # omegaconf validation: wrong type / unknown key
            raise ConfigError(f"bad value {value!r} for {path}: {exc}") from None
    if check:
        refusals.check(cfg, [*overrides, *(updates or {})], _DEFAULTS[0])
    return cfg


#: the composition without overrides (conf/config.yaml's choices), composed once per process: what the user set
#: is what differs from it (core/config/reads.py)
_DEFAULTS: list = []
