"""Worker modules of this directory, loaded by file (spawned ranks load them by path, so they are not packages)."""

from __future__ import annotations

import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def path_of(name: str) -> str:
    return os.path.join(HERE, f"{name}.py")


def load(name: str):
    """This directory's ``name.py`` as a module (a fresh one each call)."""
    spec = importlib.util.spec_from_file_location(name, path_of(name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
