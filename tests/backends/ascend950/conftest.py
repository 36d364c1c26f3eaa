"""Fixtures of the ascend950 tests: a fake torch_npu (injected, never imported from site-packages)
wrapped in the contract recorder, and the wrappers bound to it."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from inferhal.backends.ascend950.contract import RecordingNpu
from inferhal.backends.ascend950.ops import NpuOps

_spec = importlib.util.spec_from_file_location("ascend950_fake_npu", pathlib.Path(__file__).with_name("fake_npu.py"))
fake_npu_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_npu_module)


@pytest.fixture
def recorder():
    return RecordingNpu(fake_npu_module.FakeNpu())


@pytest.fixture
def npu_ops(recorder):
    return NpuOps(recorder)
