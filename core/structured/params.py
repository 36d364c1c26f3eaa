"""``StructuredOutputs``: the constraint of one request (vLLM's structured-output request fields).

Exactly one of ``json`` (a JSON schema, as a dict or its JSON text), ``json_object`` (any JSON object),
``regex``, ``choice`` (a list of strings) or ``grammar`` (EBNF, in xgrammar's GBNF dialect) is set. A bad
value raises :class:`StructuredOutputsError` naming the field; a schema or regex that does not compile is
refused when the request is added (:mod:`.grammar`), for that request only.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from inferhal.core.errors import UserError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsError(UserError, ValueError):
    """A structured-output constraint is malformed; the message names the field."""


@dataclass(frozen=True)
class StructuredOutputs:
    json: Optional[Any] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    grammar: Optional[str] = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, Sequence) or not self.choice:
                raise StructuredOutputsError("structured.choice must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise StructuredOutputsError("structured.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError as e:
                    raise StructuredOutputsError(f"structured.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise StructuredOutputsError(f"structured.json must be a JSON schema (an object), got "
                                             f"{type(schema).__name__}")
            object.__setattr__(self, "json", schema)
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise StructuredOutputsError(f"structured.{name} must be a non-empty string")
        if not isinstance(self.json_object, bool):
            raise StructuredOutputsError(f"structured.json_object must be true or false, got {self.json_object!r}")
        set_ = [k for k in KINDS if (getattr(self, k) is not None and k != "json_object") or
                (k == "json_object" and self.json_object)]
        if len(set_) != 1:
            raise StructuredOutputsError(f"structured: set exactly one of {', '.join(KINDS)}; got "
                                         f"{', '.join(set_) or 'none'}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if (k == "json_object" and self.json_object) or
                    (k != "json_object" and getattr(self, k) is not None))

    def key(self) -> tuple[str, str]:
        """A canonical cache key: the kind and the constraint's text (a schema with sorted keys)."""
        k = self.kind
        if k == "json":
            return k, _json.dumps(self.json, sort_keys=True, separators=(",", ":"))
        if k == "json_object":
            return k, ""
        if k == "choice":
            return k, _json.dumps(list(self.choice))
        return k, getattr(self, k)

    @classmethod
    def coerce(cls, value: Any) -> Optional["StructuredOutputs"]:
        """``None``, a :class:`StructuredOutputs`, or a mapping of its fields (``{"json": schema}``)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            unknown = [k for k in value if k not in KINDS]
            if unknown:
                raise StructuredOutputsError(f"structured: unknown field(s) {', '.join(map(repr, unknown))}; "
                                             f"valid: {', '.join(KINDS)}")
            return cls(**dict(value))
        raise StructuredOutputsError(f"structured must be a StructuredOutputs or a mapping such as "
                                     f"{{'json': schema}}, got {type(value).__name__}")
