"""KV record formats as data: how one cached entry of ``dims`` channels lies in bytes (``cache.kv_dtype``).

- ``auto``: the model's dtype, ``dims`` elements (:class:`KVRecord`).
- ``fp8``: vLLM's DeepSeek-V4 layout (``fp8_ds_mla``): the no-RoPE channels in e4m3 with one ue8m0 scale per
  64, the RoPE channels in bf16, padded to 8 bytes: a 512-dim latent with 64 RoPE dims is 448 + 128 + 7 + 1
  = **584 B** (bytes: codes, then RoPE, then scales, then padding). A record without RoPE channels (indexer
  keys, ``fp8_index``) is e4m3 with one fp32 scale per 128 channels: 128 + 4 = 132 B.
- ``fp4``: e2m1 codes, two per byte (low nibble = even channel), then the block scales: main records as
  NVFP4 (16-channel blocks, e4m3 scales; 512 dims = 256 + 32 = **288 B**; no per-tensor second-level scale,
  so each record decodes on its own), indexer keys as MXFP4 (32-channel blocks, ue8m0 scales; 128 dims
  = 64 + 4 = **68 B**). The seeds' 890 B per token reads as 10 source layers x (288 + 68) / 4.

Scales (one per block of coded channels, ``amax`` = the block's largest magnitude):
ue8m0 = ``2**ceil(log2(amax / max_code))`` (a power of two at or above amax / max_code, so no code clips;
exponent clamped to [-126, 127]); fp32 = ``amax / max_code``; e4m3 = ``amax / 6`` rounded to e4m3 (codes
then clip at 6; a normal e4m3 scale needs block amax >= 6 * 2**-6 = 0.094, smaller blocks get a coarser
subnormal scale and below ~0.006 decode as zeros: NVFP4's per-tensor second scale is left out so that a
record decodes alone, which suits RMS-normalised latents, whose 16-channel blocks have amax ~1-3). e4m3 codes round to nearest even (torch's cast); e2m1 codes round to the nearest of
0, 0.5, 1, 1.5, 2, 3, 4, 6, ties to the even code. An all-zero block decodes to zeros.

A quantised group is paged as raw bytes (``uint8``, one record per slot). ``kv.write`` encodes with
``KVWriteParams.record``; the attention ops that read a cache decode the records they gather
(``AttnParams.kv_format``, ``IndexerParams.key_format``). The reference codec is
``backends/reference/kv_records.py``; a backend declares the ``cache.kv_dtype`` values it reads as the
device-profile feature ``kv_dtype:NAME`` (:func:`backend_kv_dtypes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

KV_DTYPES = ("auto", "fp8", "fp4")
CODE_MAX = {"e4m3": 448.0, "e2m1": 6.0}
SCALE_BYTES = {"ue8m0": 1, "e4m3": 1, "fp32": 4}


@dataclass(frozen=True)
class KVRecord:
    """One record in the model's dtype: its bytes and a description of how they lie."""

    nbytes: int
    layout: str


@dataclass(frozen=True)
class KVFormat:
    """A quantised record of ``dims`` channels: channels ``[0, coded)`` as ``code`` values with one
    ``scale``-typed scale per ``block`` of them, channels ``[coded, dims)`` (the RoPE part) kept in bf16.
    Byte offsets: codes at 0, the bf16 channels at ``raw_at``, the scales at ``scales_at``; ``nbytes``
    in all (padding included)."""

    kv_dtype: str  # fp8 | fp4
    name: str  # fp8_ds_mla | fp8_index | nvfp4 | mxfp4
    dims: int
    coded: int
    code: str  # e4m3 | e2m1
    block: int
    scale: str  # ue8m0 | fp32 | e4m3
    align: int = 1

    @property
    def code_bytes(self) -> int:
        return self.coded if self.code == "e4m3" else -(-self.coded // 2)

    @property
    def raw_dims(self) -> int:
        return self.dims - self.coded

    @property
    def num_scales(self) -> int:
        return -(-self.coded // self.block)

    @property
    def raw_at(self) -> int:
        return self.code_bytes

    @property
    def scales_at(self) -> int:
        return self.raw_at + 2 * self.raw_dims

    @property
    def nbytes(self) -> int:
        n = self.scales_at + self.num_scales * SCALE_BYTES[self.scale]
        return n + (-n % self.align)

    @property
    def layout(self) -> str:
        raw = f" + {self.raw_dims} bf16 RoPE" if self.raw_dims else ""
        pad = self.nbytes - self.scales_at - self.num_scales * SCALE_BYTES[self.scale]
        tail = f", padded to {self.align} B" if pad else ""
        return (f"{self.name}: {self.coded} {self.code} ({self.code_bytes} B){raw} + {self.num_scales} "
                f"{self.scale} scale(s){tail}")


def record(kv_dtype: str, dims: int, rope_dims: int = 0, model_dtype: torch.dtype = torch.bfloat16,
           role: str = "main") -> KVRecord | KVFormat:
    """The record of ``dims`` channels (``rope_dims`` of them rotary, the last ones) in ``kv_dtype``;
    ``role`` is ``main`` (latent or compressed KV) or ``index`` (lightning-indexer keys)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"cache.kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if role not in ("main", "index"):
        raise ValueError(f"a KV record's role is main or index, got {role!r}")
    if kv_dtype == "auto":
        size = torch.empty((), dtype=model_dtype).element_size()
        return KVRecord(dims * size, f"{dims} x {str(model_dtype).replace('torch.', '')}")
    if kv_dtype == "fp8":
        if role == "index" or not rope_dims:
            return KVFormat("fp8", "fp8_index", dims, dims, "e4m3", 128, "fp32")
        return KVFormat("fp8", "fp8_ds_mla", dims, dims - rope_dims, "e4m3", 64, "ue8m0", align=8)
    if role == "index":
        return KVFormat("fp4", "mxfp4", dims, dims, "e2m1", 32, "ue8m0")
    return KVFormat("fp4", "nvfp4", dims, dims, "e2m1", 16, "e4m3")


def backend_kv_dtypes(profile: Any) -> tuple[str, ...]:
    """The ``cache.kv_dtype`` values a backend's ops read: ``auto`` always, plus each ``kv_dtype:NAME``
    feature of its device profile."""
    return ("auto",) + tuple(k for k in KV_DTYPES[1:] if profile.supports(f"kv_dtype:{k}"))


def check_backend(backend: str, profile: Any, kv_dtype: str) -> None:
    """Refuse ``kv_dtype`` (naming the backend and the formats it reads) when the backend's ops cannot read it;
    run before a model is loaded (``LLM``) and again when an engine is built."""
    from inferhal.core.errors import UserError

    readable = backend_kv_dtypes(profile)
    if kv_dtype not in readable:
        raise UserError(f"cache.kv_dtype={kv_dtype} is refused: backend {backend!r} reads KV caches in "
                        f"{', '.join(readable)} only (its device profile declares the formats its attention ops "
                        f"read); use cache.kv_dtype={readable[-1]} or backend=reference")


def apply_kv_dtype(model: Any, backend: str, profile: Any, kv_dtype: str) -> None:
    """Make ``model`` store its KV as ``kv_dtype`` records (``cache.kv_dtype``), before its KV groups are
    read: refused, naming the problem, when the value is unknown, when the backend's ops do not read that
    format, or when the model family has no quantised KV (its model lacks ``use_kv_dtype``)."""
    from inferhal.core.errors import UserError

    if kv_dtype not in KV_DTYPES:
        raise UserError(f"cache.kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    use = getattr(model, "use_kv_dtype", None)
    if kv_dtype == "auto":
        if use is not None:  # a model an earlier engine set to records goes back to values
            use("auto")
        return
    check_backend(backend, profile, kv_dtype)
    if use is None:
        raise UserError(f"cache.kv_dtype={kv_dtype} is refused: {type(model).__name__} stores its KV in the model's "
                        f"dtype only (cache.kv_dtype=auto); FP8/FP4 KV records exist for the deepseek_v4 family")
    use(kv_dtype)
