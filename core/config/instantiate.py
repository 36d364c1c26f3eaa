"""``_target_`` instantiation through an allow-list only: configs that travel with checkpoints must not
run arbitrary code (Hydra 1.4 deprecates unrestricted ``_target_``)."""

from __future__ import annotations

from typing import Any, Mapping

from inferhal.core.errors import UserError

#: Importable paths a config may name in ``_target_``. Extend by adding the exact dotted path.
ALLOWED_TARGETS: frozenset[str] = frozenset({
    "inferhal.core.config.schema.BackendConfig",
    "inferhal.core.config.schema.SchedulerConfig",
    "inferhal.core.config.schema.CacheConfig",
    "inferhal.core.config.schema.SamplingConfig",
})


class InstantiationRefused(UserError):
    """A ``_target_`` outside :data:`ALLOWED_TARGETS`."""


def _check(node: Any) -> None:
    if isinstance(node, Mapping):
        target = node.get("_target_")
        if target is not None and str(target) not in ALLOWED_TARGETS:
            raise InstantiationRefused(
                f"_target_ {target!r} is not in the allow-list (inferhal.core.config.instantiate.ALLOWED_TARGETS); "
                f"allowed: {', '.join(sorted(ALLOWED_TARGETS))}"
            )
        for v in node.values():
            _check(v)
    elif isinstance(node, (list, tuple)):
        for v in node:
            _check(v)


def instantiate(config: Any, **kwargs: Any) -> Any:
    """Like ``hydra.utils.instantiate``, after checking every nested ``_target_`` against the allow-list."""
    from hydra.utils import instantiate as hydra_instantiate
    from omegaconf import DictConfig, ListConfig, OmegaConf

    plain = OmegaConf.to_container(config, resolve=True) if isinstance(config, (DictConfig, ListConfig)) else config
    _check(plain)
    return hydra_instantiate(plain, **kwargs)
