"""Config fields set to what this build cannot honour, refused at compose with the field named instead of
parsing and then doing nothing (STYLE 13: a config field that nothing reads is a lie).

:func:`check` runs at the end of :func:`inferhal.core.cli.main.compose`, the one path of every CLI command
and of the Python API (``LLM(...)`` composes through it, keyword options included). It refuses:

- a field the command does not read (:mod:`inferhal.core.config.reads`, the table of what each command reads);
- a field no command reads yet (:data:`REFUSED`; the code that gives it a meaning removes its entry);
- a value out of the range every reader needs (:data:`RANGES`, and the checks the readers of
  ``parallel.timeout_s``, ``eplb.policy`` and ``eplb.drift`` run), a KV format that does not exist, EPLB or
  two-batch overlap without the layout they need, and ``model.max_model_len`` past the context the config
  declares for the model (:mod:`inferhal.core.config.context`);
- a key added with ``+`` that no schema has.

``tests/core/config/test_refusals.py`` fails on a schema field that no source file reads and that is not listed
in :data:`REFUSED`; ``tests/core/config/test_reads.py`` on a command or group the table leaves out.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from inferhal.core.config import context, reads
from inferhal.core.config.errors import ConfigError

#: dotted field path → what is missing: no command reads these yet. A value other than the schema default is
#: refused by every command (``inferhal config`` included: it would show a setting nothing honours).
REFUSED: dict[str, str] = {
    "experiment.name": "nothing records an experiment's label (no report or result file carries it)",
    "experiment.notes": "nothing records an experiment's notes (no report or result file carries them)",
}

_MISSING = object()

#: fields whose range holds for every command, checked at compose: path → (test, the range in words). Fields
#: whose range depends on the model or the backend are checked where those are known; parallel.timeout_s,
#: eplb.policy and eplb.drift by the checks their readers run (:func:`refused`).
RANGES: dict[str, tuple[Any, str]] = {
    "model.max_model_len": (lambda v: v >= 2, ">= 2 (one prompt token and one generated token)"),
    "cache.memory_fraction": (lambda v: 0 < v <= 1, "in (0, 1] (a fraction of the device's free memory)"),
    "cache.kv_cache_bytes": (lambda v: v >= 0, ">= 0 (0: derive it from cache.memory_fraction)"),
    "cache.num_blocks": (lambda v: v >= 0, ">= 0 (0: derive it from the KV budget)"),
    "cache.auto_kv_cap_bytes": (lambda v: v >= 0, ">= 0 (0: no cap)"),
    "scheduler.long_prefill_token_threshold": (lambda v: v >= 0, ">= 0 (0: no per-request cap in a step)"),
    "eplb.num_redundant_experts": (lambda v: v >= 0, ">= 0"),
    "eplb.window_size": (lambda v: v >= 1, ">= 1 (steps of expert load per window)"),
    "eplb.step_interval": (lambda v: v >= 0, ">= 0 (steps between rebalances)"),
    "eplb.num_groups": (lambda v: v >= 0, ">= 0 (0: from the model)"),
    "eplb.num_nodes": (lambda v: v >= 1, ">= 1"),
    "eplb.layers_per_step": (lambda v: v >= 0, ">= 0 (0: every MoE layer at once)"),
    "server.host": (lambda v: bool(str(v).strip()), "an address to listen on (127.0.0.1: this host only; 0.0.0.0: "
                                                    "every interface)"),
    "log_level": (lambda v: str(v).upper() in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                  "one of DEBUG, INFO, WARNING, ERROR, CRITICAL"),
}


def default_of(path: str) -> Any:
    """The schema default of a dotted field path (``scheduler.async_scheduling`` → ``False``)."""
    from inferhal.core.config import schema

    node: Any = schema.InferhalConfig
    value: Any = _MISSING
    for part in path.split("."):
        if not dataclasses.is_dataclass(node):
            raise KeyError(path)
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            raise KeyError(path)
        f = fields[part]
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        node = value
    return value


def added_fields(cfg: Any) -> list[tuple[str, str]]:
    """``(path, message)`` for each key that is in no schema dataclass: Hydra's ``+key=value`` (and
    ``++``) adds a key to a structured node that a plain ``key=value`` would refuse as a typo. Free-form
    mappings (``model.arch``, ``backend.options``) are left to their readers, which refuse what they do
    not know."""
    from omegaconf import DictConfig, OmegaConf

    out: list[tuple[str, str]] = []

    def walk(node: Any, prefix: str) -> None:
        kind = OmegaConf.get_type(node)
        if not dataclasses.is_dataclass(kind):
            return
        names = [f.name for f in dataclasses.fields(kind)]
        for key in node.keys():
            if key not in names:
                where = prefix.rstrip(".") or "the root config"
                out.append((prefix + str(key), f"unknown config field {str(key)!r} in {where} (added with '+'): "
                                               f"nothing reads it. Valid fields: {', '.join(names)}"))
            elif isinstance(node._get_node(key), DictConfig):
                walk(node[key], f"{prefix}{key}.")

    walk(cfg, "")
    return out


def refused(cfg: Any, defaults: Any = None) -> list[tuple[str, str]]:
    """``(field path, message)`` for each field of the composed ``cfg`` that is set but cannot be honoured.
    ``defaults``: the composition without the user's overrides; with it, each field the user set that the
    command does not read is refused too (:func:`inferhal.core.config.reads.unread`)."""
    from omegaconf import OmegaConf

    out = added_fields(cfg)
    command = " ".join(str(OmegaConf.select(cfg, "command", default="") or "").split())
    for path, why in REFUSED.items():
        value = OmegaConf.select(cfg, path, default=_MISSING)
        default = default_of(path)
        if value is _MISSING or value == default:
            continue
        out.append((path, f"{path}={value!r} is refused (not honoured yet; the default is {default!r}): {why}"))
    if defaults is not None:
        out += [(p, m) for p, m in reads.unread(cfg, defaults, command) if p not in REFUSED]
    from inferhal.core.paging.formats import KV_DTYPES

    for path, (ok, words) in RANGES.items():
        value = OmegaConf.select(cfg, path, default=None)
        if value is not None and not ok(value):
            out.append((path, f"{path} must be {words}, got {value!r}"))
    out += _readers_checks(cfg)
    out += context.at_compose(cfg)

    kv_dtype = OmegaConf.select(cfg, "cache.kv_dtype", default="auto")
    if kv_dtype not in KV_DTYPES:
        out.append(("cache.kv_dtype", f"cache.kv_dtype={kv_dtype!r} is not a KV format: use one of {', '.join(KV_DTYPES)}"))
    enabled = OmegaConf.select(cfg, "eplb.enabled", default=False)
    ep = OmegaConf.select(cfg, "parallel.ep", default=1)
    if enabled and int(ep) <= 1:
        out.append(("eplb.enabled", f"eplb.enabled=True is refused with parallel.ep={ep}: EPLB balances routed "
                                    f"experts among EP ranks and runs only with parallel.ep > 1 (e.g. parallel=ep2); "
                                    f"otherwise use eplb=disabled"))
    tbo, dp = OmegaConf.select(cfg, "parallel.tbo", default=False), OmegaConf.select(cfg, "parallel.dp", default=1)
    if tbo and not int(dp) == int(ep) > 1:
        out.append(("parallel.tbo", f"parallel.tbo=True is refused with parallel.dp={dp}, parallel.ep={ep}: two-batch "
                                    f"overlap hides one micro-batch's MoE all-to-all behind the other's attention and "
                                    f"runs only with data-parallel attention (parallel.dp = parallel.ep > 1, e.g. "
                                    f"parallel=dep2); otherwise use parallel.tbo=false"))
    return out


def _readers_checks(cfg: Any) -> list[tuple[str, str]]:
    """The checks the readers of parallel.timeout_s, eplb.policy and eplb.drift run, at compose for every command
    (an EP rank ran them only after spawning and loading)."""
    from inferhal.core.eplb.baseline import drift_of, policy_of
    from inferhal.core.errors import UserError
    from inferhal.core.config.values import timeout_of

    out = []
    for path, check in (("parallel.timeout_s", lambda: timeout_of(cfg.parallel)),
                        ("eplb.policy", lambda: policy_of(str(cfg.eplb.policy))),
                        ("eplb.drift", lambda: drift_of(cfg.eplb.drift))):  # refused whichever policy is set
        try:
            check()
        except UserError as exc:
            out.append((path, str(exc)))
    return out


def check(cfg: Any, overrides: Sequence[str] = (), defaults: Any = None) -> None:
    """Raise :class:`ConfigError` naming every field of ``cfg`` that this build cannot honour.
    ``overrides``: the keys the user set (``key=value`` strings or dotted paths); a refused field set
    by anything else gets a hint that a config option set it. ``defaults``: see :func:`refused`."""
    found = refused(cfg, defaults)
    if not found:
        return
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    lines = [msg for _, msg in found]
    fields = sum(len(path.split(", ")) for path, _ in found)  # a group's fields refused in one message
    if fields > 1:
        lines = [f"{fields} config fields are refused:", *(f"  {ln}" for ln in lines)]
    if any(path not in keys for path, _ in found):
        lines.append("(a config option such as parallel=NAME or eplb=NAME sets a field too: override the field "
                     "or choose another option)")
    raise ConfigError("\n".join(lines))
