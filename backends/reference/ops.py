"""Reference implementations of the op vocabulary, in plain PyTorch: the numerical oracle.

Each function has the signature documented for its op ID in :mod:`inferhal.core.ops.vocabulary`.
They favour clarity over speed, accumulate in fp32 and run on any torch device. Model-specific ops
live in sibling modules (``attention.py``, ``moe.py``, ``mhc.py``) and are collected in :data:`OPS`.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from inferhal.backends.reference import kv_records
from inferhal.backends.reference.elementwise import norm_rms, norm_scale, rope_apply  # noqa: F401 (ops' names)
from inferhal.backends.reference.matmul import product
from inferhal.backends.reference.sampling import argmax_rows, filtered_probs, sample  # noqa: F401 (ops' names)
from inferhal.core.ops.quantize import dequantize
from inferhal.core.ops.params import ActParams, KVWriteParams
from inferhal.core.ops.quant import QuantWeight


def linear(x: torch.Tensor, w: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None, *,
           mm=product) -> torch.Tensor:
    wd = dequantize(w, x.dtype) if isinstance(w, QuantWeight) else w.to(x.dtype)
    return mm(x, wd, None if bias is None else bias.to(x.dtype))


#: vocabulary rows per product in :func:`lm_head`
LM_HEAD_CHUNK = 32768


def lm_head(x: torch.Tensor, w: torch.Tensor | QuantWeight, out: torch.Tensor | None = None, *,
            mm=product) -> torch.Tensor:
    """fp32 logits ``[B, V]`` of ``linear(x, w)``. A plain weight runs in vocabulary chunks of
    :data:`LM_HEAD_CHUNK` rows, each widened into its columns of the result while it is still in cache: no
    full-size logits in x's dtype and no second pass to widen them (at a 262,144-token vocabulary and 32
    rows that pass and its fresh pages cost as much as a third of the bf16 product itself, measured on one
    CPU thread). A quantised weight (not sliceable by rows) runs as one product."""
    v = w.shape[0]
    if out is None:
        out = torch.empty(x.shape[0], v, dtype=torch.float32, device=x.device)
    elif tuple(out.shape) != (x.shape[0], v) or out.dtype != torch.float32:
        raise ValueError(f"lm_head: logits buffer is {out.dtype} {tuple(out.shape)}, needs float32 {(x.shape[0], v)}")
    if not isinstance(w, torch.Tensor):
        return out.copy_(linear(x, w, mm=mm))
    for s in range(0, v, LM_HEAD_CHUNK):
        out[:, s : s + LM_HEAD_CHUNK] = linear(x, w[s : s + LM_HEAD_CHUNK], mm=mm)
    return out


def lm_head_argmax(x: torch.Tensor, w: torch.Tensor | QuantWeight, *, mm=product) -> torch.Tensor:
    """Greedy tokens ``[B]`` int64: :func:`argmax_rows` of :func:`lm_head` (first index on ties, as
    ``sample``'s greedy rows)."""
    return argmax_rows(lm_head(x, w, mm=mm))


def act_gated(gate: torch.Tensor, up: torch.Tensor, p: ActParams) -> torch.Tensor:
    a = F.gelu(gate, approximate="tanh") if p.kind == "gelu_tanh" else F.silu(gate)
    return a * up


def embed(ids: torch.Tensor, table: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    x = F.embedding(ids.long(), table)
    if scale != 1.0:
        x = x * torch.tensor(scale, dtype=table.dtype)
    return x


def topk_select(scores: torch.Tensor, k: int, valid_len: torch.Tensor | None = None) -> torch.Tensor:
    # scores: [T, S]; stable ordering: larger score first, then lower index.
    t, s = scores.shape
    sc = scores.float()
    if valid_len is not None:
        cols = torch.arange(s, device=scores.device)
        sc = sc.masked_fill(cols[None, :] >= valid_len[:, None], float("-inf"))
    kk = min(k, s)
    order = torch.sort(sc, dim=-1, descending=True, stable=True).indices[:, :kk]
    picked = sc.gather(1, order)
    idx = torch.where(torch.isinf(picked) & (picked < 0), torch.full_like(order, -1), order)
    if kk < k:
        idx = torch.cat((idx, idx.new_full((t, k - kk), -1)), dim=1)
    return idx


def kv_write(
    values: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    p: KVWriteParams = KVWriteParams(),
    scale_cache: torch.Tensor | None = None,
) -> None:
    # values: [T, *slot]; cache: [NB, BS, *slot] (may be a strided view); slot_mapping: [T], -1 = skip
    bs = cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blk, off = slots // bs, slots % bs
    v = values[keep]
    if p.record is not None:  # one quantised record per entry (core/paging/formats.py)
        if cache.dtype != torch.uint8 or cache.shape[2:] != (p.record.nbytes,):
            raise ValueError(f"kv.write {p.record.name}: cache must be uint8 [NB, BS, {p.record.nbytes}], got "
                             f"{cache.dtype} {tuple(cache.shape)}")
        cache[blk, off] = kv_records.encode(v.reshape(v.shape[0], -1), p.record)
    elif p.quant == "fp8":
        if scale_cache is None:
            raise ValueError("kv.write with quant='fp8' needs scale_cache [NB, BS]")
        amax = v.float().reshape(v.shape[0], -1).abs().amax(dim=1).clamp(min=1e-12)
        scale = amax / 448.0
        shape = (-1,) + (1,) * (v.dim() - 1)
        cache[blk, off] = (v.float() / scale.view(shape)).clamp(-448, 448).to(cache.dtype)
        scale_cache[blk, off] = scale.to(scale_cache.dtype)
    else:
        cache[blk, off] = v.to(cache.dtype)


_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def sample_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """``sample.mask``: -inf on the tokens whose bit is 0 in each constrained row's bitmask (in place)."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != rows.numel():
        raise ValueError(f"sample.mask: bitmask must be int32 [len(rows)={rows.numel()}, ceil(V/32)], got "
                         f"{bitmask.dtype} {tuple(bitmask.shape)}")
    v = logits.shape[1]
    if bitmask.shape[1] * 32 < v:
        raise ValueError(f"sample.mask: bitmask covers {bitmask.shape[1] * 32} tokens, logits have {v}")
    if rows.numel() == 0:
        return
    # the int32 words' bytes in memory order (little-endian) are tokens 8k..8k+7 of byte k, bit j = token 8k+j:
    # unpacked a byte at a time (an eighth of the int32 shifts' traffic), each row filled in place (no gather
    # and scatter of [rows, V] fp32): 6.5 against 11.6 ms at 22 rows x 262,144 tokens on the Zen 4 host
    if sys.byteorder == "little":
        banned = (bitmask.contiguous().view(torch.uint8)[:, :, None] & _BITS.to(bitmask.device)).eq(0)
    else:  # big-endian: the words' bits by shifting
        banned = ((bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32, device=bitmask.device)) & 1).eq(0)
    banned = banned.reshape(rows.numel(), -1)[:, :v]
    for j, r in enumerate(rows.tolist()):
        logits[r].masked_fill_(banned[j], float("-inf"))


def _ops() -> dict:
    from inferhal.backends.reference import attention, deepseek, ep, mhc, moe, spec

    table = {
        "norm.rms": norm_rms,
        "rope.apply": rope_apply,
        "linear": linear,
        "lm_head": lm_head,
        "lm_head.argmax": lm_head_argmax,
        "embed": embed,
        "act.gated": act_gated,
        "topk.select": topk_select,
        "kv.write": kv_write,
        "sample": sample,
        "sample.mask": sample_mask,
    }
    for mod in (attention, moe, mhc, spec, deepseek, ep):
        table.update(mod.OPS)
    return table


OPS = _ops()

#: ops whose matrix products take ``mm=`` (see matmul.py); batch-invariant mode binds the tiled product
MATMUL_OPS = ("linear", "lm_head", "lm_head.argmax", "moe.experts", "mhc.pre", "mhc.head")
#: row-independent ops with elementwise tails, and which positional arguments carry the rows
ROWWISE_OPS = {"act.gated": (0, 1), "mhc.pre": (0,), "mhc.head": (0,), "mhc.post": (0, 1, 2, 3), "moe.route": (0, 3, "hash_ids")}


def batch_invariance() -> dict:
    """op ID -> its batch invariance: every op only in the batch-invariant mode (``backend.batch_invariant=true``,
    :func:`ops_for`), where the model-level needle tests (tests/core/engine/test_deterministic.py,
    tests/backends/reference/test_batch_invariant_gemma3.py) check it bitwise; the default mode's products
    (oneDNN, F.linear) and attention (a padded gather) depend on the batch."""
    from inferhal.backends.reference.attention import KEY_CHUNK
    from inferhal.backends.reference.matmul import TILE_ROWS
    from inferhal.core.ops.invariance import BatchInvariance

    why = {op: f"matrix products over fixed {TILE_ROWS}-row tiles" for op in MATMUL_OPS}
    for op in ROWWISE_OPS:
        why[op] = (why[op] + ", " if op in why else "") + f"row-wise work over fixed {TILE_ROWS}-row tiles"
    why["indexer.scores"] = "scores in a fixed order per row"
    why["moe.route"] += "; each row's experts sorted by id (the summation order)"
    why["attn.paged"] = "one query row at a time over exactly its own visible keys"
    why["attn.sparse_topk"] = (f"each row's visible keys first, summed over fixed {KEY_CHUNK}-key slices in a "
                               "fixed tree (masked keys past them add exact zeros, however wide the top-k row)")
    rest = "each row computed from its own inputs by torch ops over its own dimensions"
    return {op: BatchInvariance(True, why.get(op, rest), mode_only=True) for op in OPS}


def ops_for(batch_invariant: bool) -> dict:
    """The op table; ``batch_invariant``: every matrix product over fixed row tiles, row-wise ops over fixed
    tiles, the indexer's and the router's orders fixed, paged attention one row at a time over its own keys,
    sparse attention's sums over fixed key slices (whatever the top-k row's width)."""
    if not batch_invariant:
        return dict(OPS)
    import functools

    from inferhal.backends.reference.attention import attn_paged_rowwise
    from inferhal.backends.reference.matmul import row_tiled, tiled_linear

    table = {op: functools.partial(fn, mm=tiled_linear) if op in MATMUL_OPS else fn for op, fn in OPS.items()}
    for op, rows in ROWWISE_OPS.items():
        table[op] = row_tiled(table[op], rows)
    table["indexer.scores"] = functools.partial(table["indexer.scores"], fixed_order=True)
    table["moe.route"] = functools.partial(table["moe.route"], fixed_order=True)
    table["attn.sparse_topk"] = functools.partial(table["attn.sparse_topk"], fixed_order=True)
    table["attn.paged"] = attn_paged_rowwise
    return table
