"""The reference's matrix products, with an optional batch-invariant mode.

:func:`product` is the default: ``F.linear``, except fp32 and bf16 on the CPU, which go through oneDNN's
inner product on a weight packed once (below) where the host can run it. On the development machines
(AMD EPYC) torch's fp32 ``F.linear`` runs MKL's GEMM at about half the speed of oneDNN's: 190 vs 91 ms
for Gemma 3's LM head at 32 rows, 5.2 vs 2.4 ms for a 200×640·640×2048 product (one thread).

CPU BLAS picks a different kernel (and so a different summation order) for different row counts, so a
row's result from ``F.linear`` can change in the last bits with the batch it shares. In batch-invariant
mode (``backend.batch_invariant=true``) every product runs over fixed tiles of
:data:`TILE_ROWS` rows, zero-padded, so each row sees the same kernel whatever the batch. It costs
speed, which is why it is a mode and not the default.

On the CPU a weight that takes part in fp32 or bf16 products is packed once into oneDNN's blocked
layout (``mkldnn._reorder_linear_weight``) and the packed copy is reused by every later product: the
reorder otherwise runs inside each call. For Gemma 3's decode products at 32 rows that cut the time of a
layer's seven products by about a quarter (1.42 → 1.05 ms bf16, 3.66 → 2.74 ms fp32, this session's Intel
host). Packed copies are kept per weight (data pointer, shape, strides, dtype, version counter: a weight
written in place is packed again) up to :data:`PACK_BYTES` in all (:class:`PackCache`); past that,
products run unpacked.

**Portable path.** ``torch.ops.mkldnn`` is private and depends on the CPU: on an AVX2-only host
``_reorder_linear_weight`` refuses bf16 ("bf16 path needs the cpu support avx_ne_convert or avx512bw,
avx512vl and avx512dq") and ``_linear_pointwise`` finds no bf16 primitive. So :func:`product_path` probes,
once per process on first use, each dtype: it packs a tiny weight, runs the packed and the unpacked
oneDNN product with a bias and compares them with ``F.linear`` (small integers, so every correct kernel
gives the same bits). A dtype whose probe passes runs through oneDNN; any other runs the public
``F.linear``. ``INFERHAL_PORTABLE_CPU=1`` (read once, with the probe) forces ``F.linear`` for every dtype
whatever the CPU, so an AVX-512 machine can prove the portable path. ``inferhal backends`` (the
reference's reason) and the reference profile's ``sources["products"]`` say which path runs and why
(:func:`describe`). ``ONEDNN_MAX_CPU_ISA=AVX2`` makes oneDNN behave as on an AVX2-only host: the bf16
probe then fails with the message above, here too.

What the two paths give, measured at Gemma 3 270M's shapes (q 640→1024, k/v 640→256, o 1024→640,
gate/up 640→2048, down 2048→640, LM head 640→262144; 1, 7, 32 and 200 rows; torch 2.13.0, AMD EPYC Zen 4):

- bf16: where oneDNN runs bf16 (the probe passes), ``F.linear`` is **bit-identical** to the packed product
  at every shape and row count above (and was on this project's Sapphire Rapids host): it runs the same
  oneDNN kernel, reordering the weight inside each call. On an AVX2-only host (emulated with
  ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``) ``F.linear`` runs ATen's own GEMM, also accumulating
  in fp32 but in another order: 0.01–0.06 % of the outputs differ, by 1 bf16 ulp mostly (up to 10 ulps
  where the sum cancels to a value much smaller than its terms; 1.6e-2 absolute at most). Every path's
  error against a float64 product stays within 0.22 · 2⁻⁸ · Σ|x·w|: it is the rounding of the output to bf16.
- fp32: ``F.linear`` (MKL's sgemm here; the same bits under the AVX2 emulation) sums in another order
  than oneDNN: ~92 % of the outputs differ in the last bits, by at most 8.6e-6 absolute (LM head,
  200 rows). Against a float64 product the packed path stays within 6.7 · 2⁻²⁴ · Σ|x·w| and
  ``F.linear`` within 2.5 · 2⁻²⁴ · Σ|x·w|: both are fp32 products with fp32 accumulation, which is what
  the reference documents (tests compare fp32 results with a tolerance, never bit for bit).
"""

from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferhal.core.ops import mapped

TILE_ROWS = 16
#: the switch that forces the portable product (``F.linear``) whatever the CPU; read once
PORTABLE_ENV = "INFERHAL_PORTABLE_CPU"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")

_MKLDNN = getattr(torch.ops, "mkldnn", None)
_LINEAR = getattr(_MKLDNN, "_linear_pointwise", None)  # oneDNN inner product (packed or plain weight)
_REORDER = getattr(_MKLDNN, "_reorder_linear_weight", None)  # packs a weight into oneDNN's layout
PACK_BYTES = 4 << 30  # most bytes of packed weight copies kept by each cache
PACK_ROWS_HINT = 32  # the row count oneDNN picks the packed layout for (it serves any row count)
#: the dtypes whose CPU products may go through oneDNN, each probed on its own
PROBED = (torch.bfloat16, torch.float32)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ProductPath:
    """Which dtypes' CPU products run through oneDNN's packed kernel (the rest run ``F.linear``), and why."""

    packed: frozenset  # of torch dtypes
    reason: str

    def describe(self) -> str:
        names = lambda ds: ", ".join(sorted(_dtype_name(d) for d in ds))  # noqa: E731
        if self.packed == frozenset(PROBED):
            return f"products: oneDNN packed ({self.reason})"
        if not self.packed:
            return f"products: portable F.linear ({self.reason})"
        rest = [d for d in PROBED if d not in self.packed]
        return f"products: oneDNN packed for {names(self.packed)}, portable F.linear for {names(rest)} ({self.reason})"


def portable_forced() -> bool:
    """Whether ``INFERHAL_PORTABLE_CPU`` asks for the portable path (a UserError on a value it cannot read)."""
    raw = os.environ.get(PORTABLE_ENV, "")
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    from inferhal.core.errors import UserError

    raise UserError(f"{PORTABLE_ENV}={raw!r}: expected 1 (force the portable F.linear products) or 0 / unset")


def probe_onednn(dtype: torch.dtype) -> str | None:
    """None when this host runs oneDNN's packed and plain ``dtype`` products and they agree with
    ``F.linear``; else why not. x, w and bias hold small integers, so every sum is exact in fp32 and its
    bf16 rounding is the same for any correct kernel: a mismatch is a broken path, not a rounding."""
    if _LINEAR is None or _REORDER is None:
        return "this torch build has no torch.ops.mkldnn._linear_pointwise / _reorder_linear_weight"
    if not torch.backends.mkldnn.is_available():
        return "torch.backends.mkldnn is not available in this build"
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-2, 3, (24, 40), generator=g).to(dtype)  # [N, K]; N, K: no multiple of a vector width
    b = torch.randint(-8, 9, (24,), generator=g).to(dtype)
    try:
        wp = _REORDER(w, PACK_ROWS_HINT)
        for m in (1, 5):
            x = torch.randint(-2, 3, (m, 40), generator=g).to(dtype)
            want = F.linear(x, w, b)
            for name, weight, bias in (("packed", wp, b), ("packed", wp, None), ("plain", w, b)):
                got = _LINEAR(x, weight, bias, "none", [], "")
                if not torch.equal(got, want if bias is not None else F.linear(x, w)):
                    return f"the {name} oneDNN product differs from F.linear at {m} rows"
    except Exception as exc:  # noqa: BLE001 - any refusal (RuntimeError, NotImplementedError, ...) is the answer
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[0] if lines else '(no message)'}"
    return None


@functools.cache
def product_path() -> ProductPath:
    """The CPU product path of this process: :data:`PORTABLE_ENV` read and each dtype of :data:`PROBED`
    probed (:func:`probe_onednn`) on first call, then kept. ``product_path.cache_clear()`` asks again."""
    if portable_forced():
        return ProductPath(frozenset(), f"{PORTABLE_ENV}={os.environ[PORTABLE_ENV]}")
    failed = {dt: probe_onednn(dt) for dt in PROBED}
    ok = frozenset(dt for dt, why in failed.items() if why is None)
    parts = [f"probe passed: {', '.join(sorted(_dtype_name(d) for d in ok))}"] if ok else []
    parts += [f"probe failed for {_dtype_name(d)}: {why}" for d, why in failed.items() if why is not None]
    return ProductPath(ok, "; ".join(parts))


def describe() -> str:
    """One line for ``inferhal backends`` and the reference profile: which path runs the CPU products, and why."""
    return product_path().describe()


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
        if source is None:  # the products read the copy from now on: a memory-mapped original's pages go back
            mapped.release(w)
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
    itself when it cannot be kept or its dtype runs the portable path (:func:`product_path`)."""
    if w.dtype not in product_path().packed:
        return w
    wp = ONEDNN_PACKS.get(w)
    return w if wp is None else wp


def clear_packed() -> None:
    """Drop every oneDNN copy (they are packed again on next use)."""
    ONEDNN_PACKS.clear()


def product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)``: x [..., K], w [N, K] -> [..., N]; fp32 and bf16 on the CPU through oneDNN
    with the weight packed once (:func:`packed`) where :func:`product_path` allows it."""
    if (x.device.type != "cpu" or w.device.type != "cpu" or w.dtype != x.dtype or x.numel() == 0 or x.dim() < 2
            or w.dim() != 2 or (bias is not None and bias.dtype != x.dtype) or x.dtype not in product_path().packed):
        return F.linear(x, w, bias)
    x2 = x.reshape(-1, x.shape[-1])
    out = _LINEAR(x2, packed(w), bias, "none", [], "")
    return out.reshape(*x.shape[:-1], w.shape[0])


def tiled_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [M, K] (or [..., K]); w: [N, K] -> [M, N], identical per row for any M
    x2 = x.reshape(-1, x.shape[-1])
    return row_tiled(F.linear, (0,))(x2, w, bias).reshape(*x.shape[:-1], w.shape[0])


def row_tiled(fn, row_args: tuple[int | str, ...]):
    """``fn`` run over fixed tiles of :data:`TILE_ROWS` rows (zero-padded) of its arguments ``row_args``
    (positions, or names of keyword arguments; absent or None ones are skipped), outputs concatenated. CPU
    elementwise loops compute a vector's tail with scalar code whose last bit can differ, and where a row's
    elements land depends on the batch size; fixed tiles make each row's elements land in the same places
    whatever the batch."""
    import functools

    @functools.wraps(fn)
    def tiled(*args, **kwargs):
        given = dict(enumerate(args), **kwargs)
        rows = [i for i in row_args if given.get(i) is not None]
        m = given[rows[0]].shape[0]
        padded = {i: F.pad(given[i], (0, 0) * (given[i].dim() - 1) + (0, -m % TILE_ROWS)) for i in rows}
        outs = []
        for s in range(0, max(m, 1) + (-max(m, 1) % TILE_ROWS), TILE_ROWS):
            part, kw = list(args), dict(kwargs)
            for i, t in padded.items():
                (part if isinstance(i, int) else kw)[i] = t[s : s + TILE_ROWS]
            outs.append(fn(*part, **kw))
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(o)[:m] for o in zip(*outs))
        return torch.cat(outs)[:m]

    return tiled
