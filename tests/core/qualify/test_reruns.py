"""core/qualify/runner.py: how many determinism reruns the kit gives a backend's cases."""

from __future__ import annotations

from types import SimpleNamespace

from inferhal.core.profile import ExecLevel
from inferhal.core.qualify.runner import DEFAULT_RERUNS, reruns_for


def _backend(level: ExecLevel):
    return SimpleNamespace(profile=SimpleNamespace(exec_level=level))


def test_an_interpreter_reruns_once_a_device_by_default_and_the_option_wins():
    assert reruns_for(_backend(ExecLevel.INTERPRETER)) == 1
    assert reruns_for(_backend(ExecLevel.DEVICE)) == DEFAULT_RERUNS == 2
    assert reruns_for(_backend(ExecLevel.INTERPRETER), 5) == 5  # --inferhal-reruns=5
    assert reruns_for(_backend(ExecLevel.DEVICE), 5) == 5
