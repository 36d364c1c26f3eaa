"""Config values checked where more than one layer reads them: the readers call these, and compose runs the
same check for every command (:mod:`inferhal.core.config.refusals`), so a bad value is refused with one message
before anything starts."""

from __future__ import annotations

from typing import Any

from inferhal.core.errors import UserError


def timeout_of(parallel: Any) -> float:
    """``parallel.timeout_s`` (how long a rank waits for its peers to join, and in each collective), checked."""
    t = float(getattr(parallel, "timeout_s", 120.0))
    if not t > 0:
        raise UserError(f"parallel.timeout_s={t:g} must be > 0 (seconds a rank waits for the others to join the "
                        f"group, and in each collective)")
    return t
