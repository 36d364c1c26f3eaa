"""Reading a running server over HTTP for the benches: a page's status and body, and one figure of its
Prometheus ``/metrics`` text. A leaf: :mod:`.serve`, :mod:`.serve_dp` and the benches built on them import it."""

from __future__ import annotations

import urllib.request


def get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    """(HTTP status, body) of ``GET url``; an error status with its reason, 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except OSError as exc:  # (urllib's HTTPError is one, with its code)
        return getattr(exc, "code", 0) or 0, str(exc)


def metric(text: str, name: str) -> float:
    """The value of the first series named ``name`` in Prometheus text (any labels); NaN when there is none."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")
