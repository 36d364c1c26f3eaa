"""Turn Hydra/OmegaConf composition failures into messages that name the field or option and list the
valid choices."""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Sequence

from inferhal.core.errors import UserError


class ConfigError(UserError):
    """A config or override that does not compose or validate."""


def _schema_fields(path: str) -> list[str] | None:
    from inferhal.core.config.schema import InferhalConfig

    node = InferhalConfig
    for part in [p for p in path.split(".") if p]:
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            return None
        typ = fields[part].type
        node = getattr(__import__("inferhal.core.config.schema", fromlist=["x"]), str(typ), None) if isinstance(typ, str) else typ
        if not dataclasses.is_dataclass(node):
            return None
    return [f.name for f in dataclasses.fields(node)]


def _causes(exc: BaseException):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def explain(exc: BaseException, overrides: Sequence[str] = ()) -> str:
    text = "\n".join(dict.fromkeys(str(e).strip() for e in _causes(exc) if str(e).strip()))
    # an unknown key: name the valid fields of that node
    m = re.search(r"Key '([^']+)' (?:is )?not in (?:struct|'(\w+)')", text)
    full = re.search(r"full_key: ([\w.]+)", text)
    if m:
        key = m.group(1)
        parent = ""
        if full:
            parent = full.group(1).rsplit(".", 1)[0] if "." in full.group(1) else ""
        else:
            for ov in overrides:
                k = ov.split("=", 1)[0].lstrip("+~")
                if k.endswith(key):
                    parent = k[: -len(key)].rstrip(".")
        fields = _schema_fields(parent)
        if fields is not None:
            where = parent or "the root config"
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" Did you mean {(parent + '.' if parent else '') + close[0]!r}?" if close else ""
            return f"unknown config field {key!r} in {where}.{hint} Valid fields: {', '.join(fields)}"
    # an unknown group option: Hydra lists them; add a suggestion
    m = re.search(r"Could not find '([\w/]+)/([^']+)'", text)
    if m:
        group, option = m.group(1), m.group(2)
        opts = re.findall(r"^\t(\S+)$", text, flags=re.M)
        close = difflib.get_close_matches(option, opts, n=1)
        hint = f" Did you mean {group}={close[0]}?" if close else ""
        return f"unknown option {option!r} for config group {group!r}.{hint} Valid choices: {', '.join(opts) or '(none)'}"
    m = re.search(r"Value '([^']*)' (?:of type '\w+' )?could not be converted to (\w+)", text)
    if m and full:
        return f"{full.group(1)}: {m.group(1)!r} is not a valid {m.group(2).lower()}"
    m = re.search(r"Invalid value assigned: (\w+) is not a ListConfig, list or tuple", text)
    if m and full:  # a scalar where the schema has a list
        return f"{full.group(1)}: expected a list, e.g. {full.group(1)}=[...], got {m.group(1)}"
    return text
