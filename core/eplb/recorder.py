"""Expert load recorder: counts routed tokens per layer and physical expert over a sliding window of steps.

The MoE layer calls :meth:`LoadRecorder.record` with the *physical* expert ids its tokens were sent to
(after the logical -> physical map), once per layer per forward; the engine calls :meth:`step` once per
engine step. Counts live in a ring buffer ``[window, L, R]`` (int32), so the window load is a sum and a
step costs one row reset. Under EP each rank records only its own tokens; :meth:`window_load` sums the
ranks' counts with one ``Communicator.all_reduce`` (every rank must call it at the same step).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ExpertLoadSink(Protocol):
    """What a MoE layer needs: ``record(layer, physical_ids[T, K])`` (ids < 0 are ignored)."""

    def record(self, layer: int, physical_ids: torch.Tensor) -> None: ...


class LoadRecorder:
    """Windowed per-(layer, physical expert) token counts.

    :param num_layers: MoE layers (index ``layer`` in ``record`` is the MoE layer's index, 0-based).
    :param num_physical: physical expert slots per layer (``R``).
    :param window: steps kept; the load of the last ``window`` completed steps is reported.
    """

    def __init__(self, num_layers: int, num_physical: int, window: int) -> None:
        for name, v in (("num_layers", num_layers), ("num_physical", num_physical), ("window", window)):
            if v < 1:
                raise ValueError(f"LoadRecorder.{name} must be >= 1, got {v}")
        self.num_layers, self.num_physical, self.window = num_layers, num_physical, window
        self._ring = torch.zeros(window, num_layers, num_physical, dtype=torch.int32)
        self._current = torch.zeros(num_layers, num_physical, dtype=torch.int64)
        self.steps = 0  # completed steps

    def record(self, layer: int, physical_ids: torch.Tensor) -> None:
        """Add one forward's routing of layer ``layer``: ``physical_ids[T, K]`` (any int dtype, any device)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"record: layer {layer} outside [0, {self.num_layers})")
        ids = physical_ids.reshape(-1).to("cpu", torch.int64)
        ids = ids[ids >= 0]
        if ids.numel() and int(ids.max()) >= self.num_physical:
            raise ValueError(f"record: physical id {int(ids.max())} outside [0, {self.num_physical}) at layer {layer}")
        self._current[layer] += torch.bincount(ids, minlength=self.num_physical)

    def step(self) -> None:
        """Close the current step: its counts enter the window, the oldest step leaves."""
        self._ring[self.steps % self.window] = self._current.to(torch.int32)
        self._current.zero_()
        self.steps += 1

    def local_load(self) -> torch.Tensor:
        """``[L, R]`` int64 counts of this rank over the last ``min(steps, window)`` completed steps."""
        return self._ring.sum(dim=0, dtype=torch.int64)

    def window_load(self, comm=None) -> torch.Tensor:
        """``[L, R]`` counts summed over all ranks of ``comm`` (collective; local when ``comm`` is None)."""
        load = self.local_load()
        if comm is not None and comm.layout.world_size > 1:
            load = comm.all_reduce(load)
        return load

    def reset(self) -> None:
        """Forget everything (after a rebalance the physical ids mean different experts)."""
        self._ring.zero_()
        self._current.zero_()
        self.steps = 0


def logical_load(physical_load: torch.Tensor, phy2log: torch.Tensor, num_logical: int) -> torch.Tensor:
    """Fold ``[L, R]`` physical counts onto logical experts ``[L, E]`` through the placement's ``phy2log``."""
    return torch.zeros(physical_load.shape[0], num_logical, dtype=physical_load.dtype).scatter_add_(
        1, phy2log.long(), physical_load)
