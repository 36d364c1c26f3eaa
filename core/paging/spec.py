"""What a model needs the paged KV cache to hold, per layer group.

All groups share one pool of blocks; a block holds ``block_size`` tokens of every group, i.e.
``block_size // tokens_per_slot`` slots of a compressed group. Page sizes are per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("full", "sliding", "compressed")


@dataclass(frozen=True)
class KVGroupSpec:
    """One layer group.

    - ``full``: one slot per token, kept for the whole sequence.
    - ``sliding``: one slot per token, only the last ``window`` tokens are needed; blocks that fall
      entirely out of the window are released.
    - ``compressed``: one slot per ``tokens_per_slot`` tokens (CSA 4, HCA 128), written when a window of
      that many tokens closes (slot of entry ``e`` is written by the token at position ``(e+1)*ratio-1``).
    ``slot_shape`` is one slot of one layer, e.g. ``(2, Hk, D)`` for K and V or ``(D,)`` for a latent entry.
    """

    name: str
    kind: str
    layers: tuple[int, ...]
    slot_shape: tuple[int, ...]
    dtype: torch.dtype
    tokens_per_slot: int = 1
    window: int = 0
    record: str = ""  # how a slot's bytes lie, for reports (a quantised KV format: core/paging/formats.py)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"KV group {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "sliding" and self.window <= 0:
            raise ValueError(f"KV group {self.name!r}: a sliding group needs window > 0")
        if self.kind == "compressed" and self.tokens_per_slot <= 1:
            raise ValueError(f"KV group {self.name!r}: a compressed group needs tokens_per_slot > 1")
        if self.kind != "compressed" and self.tokens_per_slot != 1:
            raise ValueError(f"KV group {self.name!r}: only compressed groups have tokens_per_slot != 1")

    def slot_bytes(self) -> int:
        n = 1
        for d in self.slot_shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    def bytes_per_token(self) -> float:
        """KV bytes per token of context, summed over this group's layers (amortised for compressed)."""
        return self.slot_bytes() * len(self.layers) / self.tokens_per_slot

    def slots_per_block(self, block_size: int) -> int:
        if block_size % self.tokens_per_slot:
            raise ValueError(
                f"KV group {self.name!r}: block_size {block_size} is not a multiple of tokens_per_slot {self.tokens_per_slot}"
            )
        return block_size // self.tokens_per_slot
