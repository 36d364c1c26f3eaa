"""Chained block hashes for prefix caching.

The hash of logical block ``i`` of a sequence covers ``(hash of block i-1, the block_size token ids of
block i, extra keys)``, so equal hashes mean equal whole prefixes. Extra keys are whatever else changes
the KV of those tokens: a LoRA adapter name, multimodal input hashes, a per-user cache salt. Only full
blocks are hashed. BLAKE2b-128 keeps collisions out of reach without SHA-256's cost.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Hashable, Sequence

from inferhal.core.paging.block_pool import BlockHash

ROOT_HASH: BlockHash = b"inferhal-kv-root"


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple[Hashable, ...] = ()) -> BlockHash:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        extra_keys: tuple[Hashable, ...] = ()) -> list[BlockHash]:
    """Append the hashes of every newly completed full block of ``token_ids`` to ``hashes`` (in place)."""
    n_full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), n_full):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra_keys)
        hashes.append(parent)
    return hashes
