"""A model family's KV layer groups from its config alone (no weights): what ``plan kv`` and the planner size."""

from __future__ import annotations

import importlib
import inspect

from inferhal.core.errors import UserError
from inferhal.core.paging import formats


def kv_groups_for(model_cfg, kv_dtype: str = "auto"):
    try:
        mod = importlib.import_module(f"inferhal.core.models.{model_cfg.family}")
    except ImportError as exc:
        raise UserError(f"model family {model_cfg.family!r} cannot be imported: {exc}") from None
    fn = getattr(mod, "kv_groups_from_config", None)
    if fn is None:
        raise UserError(f"model family {model_cfg.family!r} offers no kv_groups_from_config(model_cfg), so its KV "
                        f"cannot be planned without loading the model")
    if kv_dtype not in formats.KV_DTYPES:
        raise UserError(f"cache.kv_dtype must be one of {', '.join(formats.KV_DTYPES)}, got {kv_dtype!r}")
    if kv_dtype == "auto":
        return list(fn(model_cfg))
    if "kv_dtype" not in inspect.signature(fn).parameters:
        raise UserError(f"model family {model_cfg.family!r} plans only cache.kv_dtype=auto (its KV groups name no "
                        f"quantised record formats)")
    return list(fn(model_cfg, kv_dtype=kv_dtype))
