"""Kernel tests run in Triton's interpreter: the mode is fixed here, at collection, before any test
module imports a kernel (``@triton.jit`` reads TRITON_INTERPRET when a kernel is defined)."""

from inferhal.kernels.runtime import use_interpreter

use_interpreter(True)
