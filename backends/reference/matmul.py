"""The reference's matrix products, with an optional batch-invariant mode.

:func:`product` is the default: ``F.linear``, except fp32 on the CPU, which goes through oneDNN's
fp32 kernel (full fp32, another blocking) where torch has it. On the development machines (AMD EPYC)
torch's fp32 ``F.linear`` runs MKL's GEMM at about half the speed of oneDNN's: 190 vs 91 ms for
Gemma 3's LM head at 32 rows, 5.2 vs 2.4 ms for a 200×640·640×2048 product (one thread). bf16 already
runs through oneDNN in ``F.linear``. Both fp32 paths stay within a few fp32 ulps of a float64 product.

CPU BLAS picks a different kernel (and so a different summation order) for different row counts, so a
row's result from ``F.linear`` can change in the last bits with the batch it shares. In batch-invariant
mode (``backend.batch_invariant=true``) every product runs over fixed tiles of
:data:`TILE_ROWS` rows, zero-padded, so each row sees the same kernel whatever the batch. It costs
speed, which is why it is a mode and not the default.

On the CPU a weight that takes part in fp32 or bf16 products is packed once into oneDNN's blocked
layout (``mkldnn._reorder_linear_weight``) and the packed copy is reused by every later product: the
reorder otherwise runs inside each call. For Gemma 3's decode products at 32 rows that cut the time of a
layer's seven products by about a quarter (1.42 → 1.05 ms bf16, 3.66 → 2.74 ms fp32, this session's Intel
host), with bf16 results bit-identical to ``F.linear``. Packed copies are kept per weight (data pointer,
shape, strides, dtype, version counter: a weight written in place is packed again) up to
:data:`PACK_BYTES` in all (:class:`PackCache`); past that, products run unpacked.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

TILE_ROWS = 16


def _onednn_fp32():
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    return op if op is not None and torch.backends.mkldnn.is_available() else None


_ONEDNN = _onednn_fp32()
_REORDER = getattr(getattr(torch.ops, "mkldnn", None), "_reorder_linear_weight", None)
PACK_BYTES = 4 << 30  # most bytes of packed weight copies kept by each cache
PACK_ROWS_HINT = 32  # the row count oneDNN picks the packed layout for (it serves any row count)


class PackCache:
    """Packed copies of weights (``pack(w)``), kept per weight while the tensor it views (its base) lives.

    A copy is found again from any view of the same storage, shape, strides and dtype, as long as the weight
    was not written in place (its version counter); the entry is dropped when the base is collected, before
    its memory can hold another weight. At most ``max_bytes`` of weights are kept; past that, and for
    tensors with no version counter (inference mode), :meth:`get` returns None and the caller runs
    unpacked. The reference keeps oneDNN copies in one (:data:`ONEDNN_PACKS`); other CPU backends keep
    their own layouts the same way."""

    def __init__(self, pack, max_bytes: int = PACK_BYTES) -> None:
        self.pack = pack
        self.max_bytes = max_bytes
        self.entries: dict = {}  # key -> (weakref to the weight's base tensor, packed copy, bytes)
        self.nbytes = 0

    @staticmethod
    def _key(w: torch.Tensor):
        try:
            return (w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype, w._version)
        except RuntimeError:  # an inference-mode tensor keeps no version counter: never cached
            return None

    def _forget(self, key) -> None:
        hit = self.entries.pop(key, None)
        if hit is not None:
            self.nbytes -= hit[2]

    def _find(self, w: torch.Tensor):
        """(key, base, entry): ``w``'s key (None: never kept), the tensor it views, and its entry if kept."""
        key = self._key(w)
        if key is None:
            return None, None, None
        base = w if w._base is None else w._base
        hit = self.entries.get(key)
        return key, base, (hit if hit is not None and hit[0]() is base else None)

    def get(self, w: torch.Tensor, source=None):
        """The packed copy of ``w``, packed now if new; None when it cannot be kept. ``source``: what is packed
        when that is not ``w`` itself (a quantised weight, kept under its data tensor ``w``)."""
        key, base, hit = self._find(w)
        if key is None:
            return None
        if hit is not None:
            return hit[1]
        # the weight's bytes: a quantised source counts its scales (and offsets) as well as its data
        size = w.numel() * w.element_size() if source is None or isinstance(source, torch.Tensor) else source.nbytes()
        if self.nbytes + size > self.max_bytes:
            return None
        wp = self.pack(w if source is None else source)
        self._forget(key)
        self.entries[key] = (weakref.ref(base), wp, size)
        self.nbytes += size
        weakref.finalize(base, self._forget, key)
        return wp

    def keeps(self, w: torch.Tensor) -> bool:
        """Whether :meth:`get` would give a packed copy of ``w`` (kept already, or room for it), without packing."""
        key, _, hit = self._find(w)
        return key is not None and (hit is not None or self.nbytes + w.numel() * w.element_size() <= self.max_bytes)

    def clear(self) -> None:
        """Drop every packed copy (they are packed again on next use)."""
        self.entries.clear()
        self.nbytes = 0


#: the reference's oneDNN copies (fp32 and bf16 weights)
ONEDNN_PACKS = PackCache(lambda w: _REORDER(w.contiguous(), PACK_ROWS_HINT))


def packed(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` in oneDNN's linear layout, packed on first use and kept (:class:`PackCache`); ``w``
    itself when it cannot be kept."""
    if _REORDER is None:
        return w
    wp = ONEDNN_PACKS.get(w)
    return w if wp is None else wp


def clear_packed() -> None:
    """Drop every oneDNN copy (they are packed again on next use)."""
    ONEDNN_PACKS.clear()


def product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)``: x [..., K], w [N, K] -> [..., N]; fp32 and bf16 on the CPU through oneDNN
    with the weight packed once (:func:`packed`)."""
    if (_ONEDNN is None or x.dtype not in (torch.float32, torch.bfloat16) or w.dtype != x.dtype
            or x.device.type != "cpu" or w.device.type != "cpu" or x.numel() == 0 or x.dim() < 2 or w.dim() != 2
            or (bias is not None and bias.dtype != x.dtype)):
        return F.linear(x, w, bias)
    x2 = x.reshape(-1, x.shape[-1])
    out = _ONEDNN(x2, packed(w), bias, "none", [], "")
    return out.reshape(*x.shape[:-1], w.shape[0])


def tiled_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [M, K] (or [..., K]); w: [N, K] -> [M, N], identical per row for any M
    x2 = x.reshape(-1, x.shape[-1])
    return row_tiled(F.linear, (0,))(x2, w, bias).reshape(*x.shape[:-1], w.shape[0])


def row_tiled(fn, row_args: tuple[int, ...]):
    """``fn`` run over fixed tiles of :data:`TILE_ROWS` rows (zero-padded) of its positional arguments
    ``row_args``, outputs concatenated. CPU elementwise loops compute a vector's tail with scalar code
    whose last bit can differ, and where a row's elements land depends on the batch size; fixed tiles
    make each row's elements land in the same places whatever the batch."""
    import functools

    @functools.wraps(fn)
    def tiled(*args, **kwargs):
        m = args[row_args[0]].shape[0]
        padded = list(args)
        for i in row_args:
            padded[i] = F.pad(args[i], (0, 0) * (args[i].dim() - 1) + (0, -m % TILE_ROWS))
        outs = []
        for s in range(0, max(m, 1) + (-max(m, 1) % TILE_ROWS), TILE_ROWS):
            part = list(padded)
            for i in row_args:
                part[i] = padded[i][s : s + TILE_ROWS]
            outs.append(fn(*part, **kwargs))
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(o)[:m] for o in zip(*outs))
        return torch.cat(outs)[:m]

    return tiled
