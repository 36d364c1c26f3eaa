"""Config fields the schema accepts but this build does not honour yet: a value other than the field's
default is refused with the field named, instead of parsing and then doing nothing (STYLE 13: a config
field that nothing reads is a lie).

:func:`check` runs at the end of :func:`inferhal.core.cli.main.compose`, the one path of every CLI
command and of the Python API (``LLM(...)`` composes through it, keyword options included). The code
that gives a field its meaning removes the field's entry from :data:`REFUSED` in the same change;
``tests/core/config/test_refusals.py`` fails on a schema field that nothing reads and that is not listed
here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from inferhal.core.config.errors import ConfigError

#: dotted field path → what is missing. A value other than the schema default is refused.
REFUSED: dict[str, str] = {
    "parallel.tp": "tensor parallelism is not implemented",
    "parallel.dp": "data-parallel attention runs in `inferhal generate` only (core/parallel/dp_engine.py)",
    "parallel.role": ("prefill/decode disaggregation runs in `inferhal serve` (parallel.role=pd: one launch; "
                      "prefill | decode | router: separate launches, core/disagg) and through the Python API"),
    "experiment.name": "nothing records an experiment's label (no report or result file carries it)",
    "experiment.notes": "nothing records an experiment's notes (no report or result file carries them)",
}

#: refused fields that some commands do honour: field → command prefixes (the planner reads KV formats)
HONOURED_BY: dict[str, tuple[str, ...]] = {
    # the planner models TP and DP attention (core/plan/): it sizes layouts the engine cannot run yet
    "parallel.tp": ("plan",),
    "parallel.dp": ("plan",
                    # DP attention x EP MoE over spawned or torchrun ranks (core/parallel/dp_engine.py); the
                    # layouts it cannot run are refused before spawning (core/parallel/launch.py: check_layout)
                    "generate"),
    "parallel.role": ("serve",),  # pd | prefill | decode | router (core/server/serve.py: check_roles)
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


def refused(cfg: Any) -> list[tuple[str, str]]:
    """``(field path, message)`` for each field of the composed ``cfg`` that is set but cannot be honoured."""
    from omegaconf import OmegaConf

    out = added_fields(cfg)
    command = str(OmegaConf.select(cfg, "command", default="") or "")
    for path, why in REFUSED.items():
        if any(command.startswith(c) for c in HONOURED_BY.get(path, ())):
            continue
        value = OmegaConf.select(cfg, path, default=_MISSING)
        default = default_of(path)
        if value is _MISSING or value == default:
            continue
        out.append((path, f"{path}={value!r} is refused (not honoured yet; the default is {default!r}): {why}"))
    from inferhal.core.paging.formats import KV_DTYPES

    for path, (ok, words) in RANGES.items():
        value = OmegaConf.select(cfg, path, default=None)
        if value is not None and not ok(value):
            out.append((path, f"{path} must be {words}, got {value!r}"))
    out += _readers_checks(cfg)

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
    output = OmegaConf.select(cfg, "output", default=None)
    if output and command.split(" ")[0] not in OUTPUT_COMMANDS:
        readers = ", ".join(c for c in OUTPUT_COMMANDS if c != "config")
        where = "; qualify writes its report under qualify.output_dir" if command.startswith("qualify") else ""
        out.append(("output", f"output={output!r} is refused by `inferhal {command}`, which does not read it "
                              f"({readers} do{where})"))
    if OmegaConf.select(cfg, "deterministic", default=False):
        if not any(command == c or command.startswith(c + " ") for c in DETERMINISTIC_COMMANDS):
            out.append(("deterministic", f"deterministic=true is refused by `inferhal {command}`: it builds its "
                                         f"engine or backend without the mode; it runs with "
                                         f"{', '.join(DETERMINISTIC_COMMANDS)} (and LLM(...))"))
    return out


def _readers_checks(cfg: Any) -> list[tuple[str, str]]:
    """The checks the readers of parallel.timeout_s, eplb.policy and eplb.drift run, at compose for every command
    (an EP rank ran them only after spawning and loading)."""
    from inferhal.core.eplb.baseline import drift_of, policy_of
    from inferhal.core.errors import UserError
    from inferhal.core.parallel.launch import timeout_of

    out = []
    for path, check in (("parallel.timeout_s", lambda: timeout_of(cfg.parallel)),
                        ("eplb.policy", lambda: policy_of(str(cfg.eplb.policy))),
                        ("eplb.drift", lambda: drift_of(cfg.eplb.drift))):  # refused whichever policy is set
        try:
            check()
        except UserError as exc:
            out.append((path, str(exc)))
    return out


#: commands that read ``output=`` (their result file; ``config`` only shows it)
OUTPUT_COMMANDS = ("generate", "plan", "kernels", "bench", "config")

#: commands that honour ``deterministic`` (they build their engine through LLM.from_config)
DETERMINISTIC_COMMANDS = ("generate", "serve", "bench e2e", "bench serve")


def check(cfg: Any, overrides: Sequence[str] = ()) -> None:
    """Raise :class:`ConfigError` naming every field of ``cfg`` that this build cannot honour.
    ``overrides``: the keys the user set (``key=value`` strings or dotted paths); a refused field set
    by anything else gets a hint that a config option set it."""
    found = refused(cfg)
    if not found:
        return
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    lines = [msg for _, msg in found]
    if len(lines) > 1:
        lines = [f"{len(lines)} config fields are refused:", *(f"  {ln}" for ln in lines)]
    if any(path not in keys for path, _ in found):
        lines.append("(a config option such as parallel=NAME or eplb=NAME sets a field too: override the field "
                     "or choose another option)")
    raise ConfigError("\n".join(lines))
