"""kernels/runtime.py's mode switch refuses a process whose triton.language was imported in the other mode (its own
``@triton.jit`` helpers, ``tl.sum`` and the like, are fixed at its import): each case in a process of its own, since
this test process runs interpreted (conftest)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CASE = """
import sys
import triton.language
from inferhal.kernels.runtime import language_mode, use_interpreter
print(language_mode())
try:
    use_interpreter({enable})
except RuntimeError as exc:
    print(exc)
else:
    print("switched")
"""


@pytest.mark.parametrize("interpret,enable", [("", True), ("1", False), ("", False)])
def test_a_triton_language_of_the_other_mode_is_refused_by_name(interpret, enable):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = interpret
    out = subprocess.run([sys.executable, "-c", CASE.format(enable=enable)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    mode, said = out.stdout.strip().splitlines()
    assert mode == str(bool(interpret))  # what triton.language was imported as
    if bool(interpret) == enable:
        assert said == "switched"
    else:
        assert said.startswith(f"cannot run Triton kernels {'interpreted' if enable else 'compiled'}: triton.language"
                               f" was imported before") and "TRITON_INTERPRET=" in said
