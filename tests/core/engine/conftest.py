"""Engine test fixtures: the reference backend and the toy model (imported by path)."""

from __future__ import annotations

import pathlib
import importlib.util

import pytest
import torch

torch.set_num_threads(1)  # tiny matmuls: threads only add contention on the 2-core machines

_TOY = pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "toy_model.py"


def _load():
    spec = importlib.util.spec_from_file_location("inferhal_tests_toy_model", _TOY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


toy = _load()


@pytest.fixture(scope="session")
def backend():
    return toy.reference_backend()


@pytest.fixture(scope="session")
def toy_module():
    return toy
