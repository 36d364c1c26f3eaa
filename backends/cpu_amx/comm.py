"""Communication of cpu_amx: the reference's torch.distributed with gloo (one host's CPUs)."""

from __future__ import annotations

from inferhal.backends.reference.comm import make_communicator

__all__ = ["make_communicator"]
