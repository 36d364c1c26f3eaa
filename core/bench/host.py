"""What the host did during a benchmark: CPU time the hypervisor took (steal), the memory read bandwidth
available right now and the rate an engine's products reach on a large product, so a run on a shared VM says
how much of the machine it had and where its floors were.

Steal is read from ``/proc/stat`` (Linux; ``None`` elsewhere): the share of all CPUs' time between two
readings that a virtual machine's vCPUs were ready to run but the hypervisor ran something else. The read
bandwidth is a multi-threaded ``torch.sum`` over a buffer far larger than any cache (the fastest of a
few passes): what a product that streams its weights from memory can hope for on this host at this moment.
"""

from __future__ import annotations

import time

#: bytes summed per bandwidth pass (far past the last-level cache of current server CPUs)
BANDWIDTH_BYTES = 512 << 20
#: (rows, N, K) of the product :func:`product_rate` times: large enough that a CPU GEMM runs at its best
RATE_SHAPE = (256, 4096, 1024)


def cpu_times(path: str = "/proc/stat") -> tuple[int, int] | None:
    """``(steal, total)`` CPU ticks of all CPUs since boot, or None where the file is missing or unreadable."""
    try:
        with open(path) as f:
            line = f.readline().split()
    except OSError:
        return None
    if not line or line[0] != "cpu" or len(line) < 9:
        return None
    try:
        ticks = [int(v) for v in line[1:]]
    except ValueError:
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice: already counted in user and nice]
    return ticks[7], sum(ticks[:8])


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share (0..1) of CPU time the hypervisor took between two :func:`cpu_times` readings."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return max(0.0, (after[0] - before[0]) / (after[1] - before[1]))


def read_bandwidth(nbytes: int = BANDWIDTH_BYTES, passes: int = 5) -> float:
    """Memory read bandwidth in bytes/s with torch's threads: the fastest of ``passes`` sums over ``nbytes``
    (the best the host gave in that moment; a bound built on it should not be undercut by a slow pass)."""
    import torch

    if nbytes < 4 or passes < 1:
        raise ValueError(f"read_bandwidth: needs nbytes >= 4 and passes >= 1, got {nbytes}, {passes}")
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best


def product_rate(linear, dtype, shape: tuple[int, int, int] = RATE_SHAPE, passes: int = 5) -> float:
    """Floating-point operations per second ``linear(x, w)`` reaches on one ``x [rows, K] . w [N, K]^T``
    product in ``dtype``: the fastest of ``passes`` calls after a first one (which packs a weight where the
    op keeps packed copies). A large product runs a CPU GEMM at its best, so this is the rate a decode step's
    products can hope for with that op on this host at this moment."""
    import torch

    m, n, k = shape
    if min(m, n, k) < 1 or passes < 1:
        raise ValueError(f"product_rate: needs a non-empty shape and passes >= 1, got {shape}, {passes}")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    linear(x, w)
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        linear(x, w)
        best = min(best, time.perf_counter() - t)
    return 2 * m * n * k / best
