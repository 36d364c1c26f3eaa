"""Communication of cpu_avx512: the reference's torch.distributed with gloo (one host's CPUs)."""

from __future__ import annotations

from inferhal.backends.cpu_amx.comm import make_communicator

__all__ = ["make_communicator"]
