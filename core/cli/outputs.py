"""Where a command will write, checked before it runs: a run of minutes must not end in a traceback from an
output path it could not write (its results lost). ``output=`` (a file) and the folder of the command's
reports (``bench.output_dir``, ``qualify.output_dir``) are created if missing and tried with a scratch file."""

from __future__ import annotations

import os
import tempfile
from typing import Any

from inferhal.core.errors import UserError

#: command (first word) → the config field naming the folder it writes its reports to
REPORT_DIRS = {"bench": "bench.output_dir", "qualify": "qualify.output_dir"}


def _try_folder(folder: str, field: str, value: str) -> None:
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".inferhal-write-check-"):
            pass
    except OSError as exc:
        raise UserError(f"{field}={value!r}: cannot write there ({exc.strerror or exc}); choose a writable "
                        f"path") from None


def check_writable(cfg: Any, command: str) -> None:
    """Raise a :class:`UserError` naming the field when ``command`` could not write its outputs."""
    from omegaconf import OmegaConf

    out = OmegaConf.select(cfg, "output", default=None)
    if out:
        out = str(out)
        if os.path.isdir(out):
            raise UserError(f"output={out!r} is a folder: give a file name (e.g. output={os.path.join(out, 'out.json')})")
        _try_folder(os.path.dirname(os.path.abspath(out)), "output", out)
    field = REPORT_DIRS.get(command.split()[0] if command else "")
    if field is not None:
        folder = OmegaConf.select(cfg, field, default=None)
        if folder:
            _try_folder(str(folder), field, str(folder))
