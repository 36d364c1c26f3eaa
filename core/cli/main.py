"""The ``inferhal`` command: ``inferhal COMMAND [SUBCOMMAND] [hydra overrides] [-m]``.

Each command lives in ``inferhal.core.cli.cmd_<command>`` and exposes ``run(cfg, words)``, where ``cfg``
is the composed root config and ``words`` the subcommand words (``inferhal plan kv`` → ``["kv"]``).
Overrides are validated against the schemas before anything runs, so a typo fails fast with the
field or option it names and the valid choices; ``-m`` sweeps through Hydra's multirun.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import sys
from typing import Sequence

from inferhal.core.cli.outputs import check_writable
from inferhal.core.config.compose import CONF_MODULE, compose
from inferhal.core.config.errors import ConfigError, explain
from inferhal.core.config.schema import register_schemas

__all__ = ["compose", "main"]
USAGE = "usage: inferhal COMMAND [SUBCOMMAND...] [key=value ...] [-m]"


def commands() -> list[str]:
    import inferhal.core.cli as pkg

    return sorted(m.name[4:] for m in pkgutil.iter_modules(pkg.__path__) if m.name.startswith("cmd_"))


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """→ (command words, overrides, flags)."""
    words, overrides, flags = [], [], []
    for arg in argv:
        if arg.startswith("-"):
            flags.append(arg)
        elif "=" in arg or overrides:
            overrides.append(arg)
        else:
            words.append(arg)
    return words, overrides, flags


def sweep_points(overrides: Sequence[str]) -> list[list[str]]:
    """Override lists that together try every value of every sweep once (validation before a multirun)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    values = [
        [f"{ov.get_key_element()}={v}" for v in ov.sweep_string_iterator()] if ov.is_sweep_override() else [ov.input_line]
        for ov in parsed
    ]
    base = [vs[0] for vs in values]
    points = [base]
    for i, vs in enumerate(values):
        points += [base[:i] + [v] + base[i + 1 :] for v in vs[1:]]
    return points


def dispatch(cfg) -> int:
    words = str(cfg.command).split()
    logging.basicConfig(level=getattr(logging, str(cfg.log_level).upper(), logging.WARNING),
                        format="%(levelname)s %(name)s: %(message)s")
    module = importlib.import_module(f"inferhal.core.cli.cmd_{words[0]}")
    check_writable(cfg, " ".join(words))  # before any work: a result that cannot be written is refused now
    rc = module.run(cfg, words[1:])
    return int(rc or 0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    words, overrides, flags = split_argv(argv)
    if not words or words[0] in ("help",) or "-h" in flags or "--help" in flags:
        print(USAGE)
        print("commands: " + ", ".join(commands()))
        print("examples: inferhal generate prompt='Hello'   inferhal backends   inferhal config backend=reference")
        return 0 if words[:1] in ([], ["help"]) or "-h" in flags or "--help" in flags else 2
    if words[0] not in commands():
        import difflib

        close = difflib.get_close_matches(words[0], commands(), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        print(f"inferhal: unknown command {words[0]!r}.{hint} Commands: {', '.join(commands())}", file=sys.stderr)
        return 2
    command = " ".join(words)
    multirun = "-m" in flags or "--multirun" in flags
    unknown = [f for f in flags if f not in ("-m", "--multirun")]
    if unknown:
        print(f"inferhal: unknown flag(s) {' '.join(unknown)}; {USAGE}", file=sys.stderr)
        return 2
    try:
        try:
            points = sweep_points(overrides) if multirun else [overrides]
        except Exception as exc:  # an override that does not parse
            raise ConfigError(explain(exc, overrides)) from exc
        for point in points:
            cfg = compose(point, command)
    except ConfigError as exc:
        print(f"inferhal: {exc}", file=sys.stderr)
        return 2
    if not multirun:
        return _run_reporting(cfg)
    return _multirun(overrides, command)


def _run_reporting(cfg) -> int:
    from inferhal.core.errors import UserError

    try:
        return dispatch(cfg)
    except (UserError, ConfigError) as exc:
        print(f"inferhal: {exc}", file=sys.stderr)
        return 2


def _multirun(overrides: Sequence[str], command: str) -> int:
    import hydra

    register_schemas()
    status: list[int] = []

    @hydra.main(version_base=None, config_path=f"pkg://{CONF_MODULE}", config_name="config")
    def _job(cfg) -> None:
        status.append(_run_reporting(cfg))

    saved = sys.argv
    sys.argv = ["inferhal", "--multirun", *overrides, f"command='{command}'"]
    try:
        _job()
    finally:
        sys.argv = saved
    return max(status, default=0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
