"""Kernel tests run in Triton's interpreter: the mode is fixed here, at collection, before any test
module imports a kernel (``@triton.jit`` reads TRITON_INTERPRET when a kernel is defined).

Tolerances (the ``close`` fixture):

Under the interpreter every kernel rounds fp32 -> bf16 to nearest even (``kernels/common.round_to``),
as the reference (torch) does, so the only differences left are fp32 accumulation order:
reductions over D terms in a different association differ by a few fp32 ulps (~1e-6 relative), which
flips a bf16 rounding at most for values sitting on a rounding boundary, i.e. by one bf16 ulp
(2**-8 relative to the value's binade, 2**-7 worst case). Chains of two roundings (a bf16 intermediate
feeding a second op, e.g. SwiGLU's h into the down GEMM) can add one more ulp per link.
"""

from inferhal.kernels.runtime import use_interpreter

use_interpreter(True)


import pytest
import torch

#: name [dtype] -> (max abs error seen, rtol, atol): printed at the end of the run (execution level: interpreter)
MAX_ERRORS: dict = {}

#: (rtol, atol) for a single rounding of an fp32 result into the dtype
SINGLE_ROUNDING = {
    torch.float32: (1e-5, 1e-5),  # fp32 re-association over <= 4096 terms
    torch.float16: (2**-10, 1e-3),  # one fp16 ulp (10 mantissa bits)
    torch.bfloat16: (2**-7, 1e-2),  # one bf16 ulp in the worst binade position
}


def check(out: torch.Tensor, ref: torch.Tensor, links: int = 1, name: str = "", scale: float = 1.0) -> float:
    """Assert ``out`` ~= ``ref`` within ``links`` roundings of ``ref.dtype``; return the max abs error.

    ``scale``: the magnitude of the terms a result sums (atol is relative to it).
    """
    rtol, atol = SINGLE_ROUNDING[ref.dtype]
    atol = atol * scale
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.dtype == ref.dtype, f"{name}: dtype {out.dtype} != {ref.dtype}"
    err = (out.float() - ref.float()).abs()
    worst = float(err.max()) if err.numel() else 0.0
    key = f"{name or 'unnamed'} [{str(ref.dtype).removeprefix('torch.')}]"
    prev = MAX_ERRORS.get(key, (0.0, rtol * links, atol * links))
    MAX_ERRORS[key] = (max(prev[0], worst), rtol * links, atol * links)
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol * links, atol=atol * links, msg=lambda m: f"{name}: {m}")
    return worst


@pytest.fixture
def close():
    return check


def dot_rows_move_freely(m: int, k: int, n: int) -> bool:
    """Whether the interpreter's ``tl.dot`` (numpy's matmul, i.e. the host's BLAS) gives a row the same bits
    wherever it sits among the ``m`` rows of a tile. An MMA row never depends on its place on a GPU; a CPU BLAS
    may pick its micro-kernel path by row position: OpenBLAS's Haswell sgemm on an AVX2-only EPYC gives about
    half the rows of a [64, 128] x [128, 64] product (and of the interpreter's [16, 32] x [32, 32] tiles) other
    last bits when moved to row 0 (measured); on the Zen 4 hosts of earlier runs the bitwise check held. Tests
    that move a row to another place in a tile assert bitwise equality only where this holds, else within one
    rounding (the same products in another order)."""
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    full, moved = a @ b, np.zeros_like(a)
    for r in range(m):
        moved[0] = a[r]
        if not np.array_equal((moved @ b)[0], full[r]):
            return False
    return True


def check_row_moved(run, x: torch.Tensor, r: int, full: torch.Tensor, tiles, name: str, scale: float) -> None:
    """Row ``r`` of ``x`` through ``run`` (a GEMM whose dots take ``tiles = (BLOCK_M, BLOCK_K, N tiles)``) against
    row ``r`` of ``full`` (``run(x)``): at its own place in its tile, the launch's other rows zero, bitwise (equal
    by construction); as row 0 of a launch of its own, bitwise where :func:`dot_rows_move_freely`, else within
    one rounding."""
    bm, bk, bns = tiles
    lo = r - r % bm
    alone = torch.zeros_like(x[lo:r + 1])
    alone[-1] = x[r]
    assert torch.equal(run(alone)[-1], full[r]), f"{name}: row {r} at its own place"
    moved = run(x[r:r + 1])
    if all(dot_rows_move_freely(bm, bk, bn) for bn in bns):
        assert torch.equal(moved, full[r:r + 1]), f"{name}: row {r} as row 0"
    else:
        check(moved, full[r:r + 1], links=1, name=f"{name}, a row moved in its tile", scale=scale)


def pytest_terminal_summary(terminalreporter):
    if MAX_ERRORS:
        terminalreporter.section("kernel max errors vs reference (execution level: interpreter)")
        for key, (err, rtol, atol) in sorted(MAX_ERRORS.items()):
            terminalreporter.write_line(f"{key:<40} max|err|={err:.3g}  (rtol={rtol:.3g}, atol={atol:.3g})")
