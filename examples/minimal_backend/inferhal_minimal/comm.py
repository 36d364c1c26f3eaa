"""A single-rank communicator: every collective is the identity."""

from __future__ import annotations


class SingleRank:
    def __init__(self, layout) -> None:
        if layout.world_size != 1:
            raise ValueError(f"the minimal backend runs on one rank; parallel layout has world_size={layout.world_size}")
        self.layout = layout

    def all_reduce(self, x):
        return x

    def all_gather(self, x):
        return [x]

    def all_to_all(self, chunks):
        return list(chunks)

    def barrier(self) -> None:
        return None

    def close(self) -> None:
        return None
