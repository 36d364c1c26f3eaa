"""Side-effect-free probing of an Ascend NPU, generation profiles as data, the device and KV storage.

Probe order, cheapest first: ``find_spec("torch_npu")`` (no import), ``/dev/davinci[0-9]*`` nodes, a
CANN toolkit (``ASCEND_HOME_PATH`` or ``/usr/local/Ascend``). Only when all three are present is
``torch_npu`` imported, and then only ``torch.npu.device_count()`` and ``torch.npu.get_device_name(i)``
are read: neither sets a device nor allocates memory (torch_npu may be *initialised* only once per
process, so the probe never calls ``set_device``, ``synchronize`` or anything that creates a context).

The SoC name (``get_device_name``, e.g. ``Ascend950PR_9589``, ``Ascend910B2``, ``Ascend910_9392``)
maps to a generation with :func:`generation_of`; each generation's capabilities are data in
:data:`GENERATIONS`, each number with its source in ``sources`` (press figures are marked "press").
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from inferhal.core.errors import UserError
from inferhal.core.profile import DeviceProfile, ExecLevel, Probe

KIB, GIB = 1024, 1024**3

# ------------------------------------------------------------------------------------------ generations


@dataclass(frozen=True)
class Generation:
    """Capabilities of one Ascend generation (per torch device, i.e. per die). 0 = not published."""

    name: str  # 950PR | 950DT | A2 | A3
    soc_prefixes: tuple[str, ...]
    memory_bytes: int
    peak_bandwidth: float  # bytes/s
    peak_flops: Mapping[str, float]
    cube_cores: int
    vector_cores: int
    ub_bytes: int  # Unified Buffer per vector core
    mxfp8: bool
    mxfp4: bool
    sources: Mapping[str, str] = field(default_factory=dict)


_TORCH_NPU_DOCS = "torch-npu==2.13.0 wheel, torch_npu/_op_plugin_docs.py"
_PRESS_950 = "press (Huawei Connect 2025 roadmap as reported; FACTS.md marks these as press, not a datasheet)"
_PLATFORM_CFG_3P = ("third-party notes quoting CANN data/platform_config/<soc>.ini (found with the code search; "
                    "not a Huawei datasheet; verify with the ini on a CANN host)")

GENERATIONS: dict[str, Generation] = {
    "950PR": Generation(
        "950PR", ("Ascend950PR",), 128 * GIB, 1.6e12,
        {"float8_e4m3fn": 1.0e15, "mxfp8": 1.0e15, "fp4_e2m1": 2.0e15, "mxfp4": 2.0e15},
        cube_cores=32, vector_cores=64, ub_bytes=256 * KIB, mxfp8=True, mxfp4=True,
        sources={
            "memory_bytes": _PRESS_950 + ": 128 GB HBM (recorded as GiB)",
            "peak_bandwidth": _PRESS_950 + ": 1.6 TB/s",
            "peak_flops": _PRESS_950 + ": 1 PFLOPS FP8, 2 PFLOPS MXFP4; bf16/fp16 not published (absent)",
            "cube_cores": _PLATFORM_CFG_3P + ": 950PR_958b cube_core_cnt=32",
            "vector_cores": _PLATFORM_CFG_3P + ": 950PR_958b vector_core_cnt=64",
            "ub_bytes": _PLATFORM_CFG_3P + ": arch35 (Ascend950) ub_size=262144 - UNVERIFIED",
            "mxfp8/mxfp4": _TORCH_NPU_DOCS + ": npu_dynamic_mx_quant supported models 'Ascend 950PR/Ascend 950DT'",
        },
    ),
    "950DT": Generation(
        "950DT", ("Ascend950DT",), 144 * GIB, 4.0e12,
        {"float8_e4m3fn": 1.0e15, "mxfp8": 1.0e15, "fp4_e2m1": 2.0e15, "mxfp4": 2.0e15},
        cube_cores=32, vector_cores=64, ub_bytes=256 * KIB, mxfp8=True, mxfp4=True,
        sources={
            "memory_bytes": _PRESS_950 + ": 144 GB HBM (recorded as GiB)",
            "peak_bandwidth": _PRESS_950 + ": 4 TB/s",
            "peak_flops": "not published for 950DT separately; 950PR's press figures assumed (same compute die) - UNVERIFIED",
            "cube_cores": "assumed equal to 950PR - UNVERIFIED",
            "vector_cores": "assumed equal to 950PR - UNVERIFIED",
            "ub_bytes": "assumed equal to 950PR - UNVERIFIED",
            "mxfp8/mxfp4": _TORCH_NPU_DOCS + ": npu_dynamic_mx_quant supported models 'Ascend 950PR/Ascend 950DT'",
        },
    ),
    "A2": Generation(
        # Ascend910B1..B4 (Atlas 800I/800T A2). Numbers of the 910B2 die; 910B4 differs (see SOC_OVERRIDES).
        "A2", ("Ascend910B",), 64 * GIB, 0.0,
        {"float16": 24 * 1.8e9 * 16 * 16 * 16 * 2, "bfloat16": 24 * 1.8e9 * 16 * 16 * 16 * 2,
         "int8": 24 * 1.8e9 * 16 * 32 * 16 * 2},
        cube_cores=24, vector_cores=48, ub_bytes=192 * KIB, mxfp8=False, mxfp4=False,
        sources={
            "memory_bytes": _PLATFORM_CFG_3P + ": Ascend910B2.ini memory_size=68719476736",
            "peak_bandwidth": "not found in a citable public source (absent)",
            "peak_flops": ("derived: cube_core_cnt 24 x cube_freq 1800 MHz x 16x16x16 MAC (int8 16x32x16, DtypeMKN) x 2, "
                           "from " + _PLATFORM_CFG_3P + " (Ascend910B2.ini)"),
            "cube_cores": _PLATFORM_CFG_3P + ": Ascend910B2.ini cube_core_cnt=24",
            "vector_cores": _PLATFORM_CFG_3P + ": Ascend910B2.ini vector_core_cnt=48",
            "ub_bytes": "hicann/catlass include/acot/arch/arch.hpp: AtlasA2 UB_SIZE = 192 * 1024",
            "mxfp8/mxfp4": _TORCH_NPU_DOCS + ": MX quantisation (npu_dynamic_mx_quant) lists 950PR/950DT only",
        },
    ),
    "A3": Generation(
        # Ascend910_93xx (Atlas 800 A3): two dies per card, one torch device per die.
        "A3", ("Ascend910_93",), 64 * GIB, 0.0, {},
        cube_cores=24, vector_cores=48, ub_bytes=192 * KIB, mxfp8=False, mxfp4=False,
        sources={
            "memory_bytes": "vllm-ascend DeepSeek-V4-Flash tutorial: 'Atlas 800 A3 (128G x 8)', 2 dies per card",
            "peak_bandwidth": "not found in a citable public source (absent)",
            "peak_flops": "cube frequency not found in a citable source (absent)",
            "cube_cores": _PLATFORM_CFG_3P + ": Ascend910_9392.ini cube_core_cnt=24",
            "vector_cores": _PLATFORM_CFG_3P + ": Ascend910_9392.ini vector_core_cnt=48",
            "ub_bytes": _PLATFORM_CFG_3P + ": Ascend910_9392.ini ub_size=196608",
            "mxfp8/mxfp4": _TORCH_NPU_DOCS + ": MX quantisation (npu_dynamic_mx_quant) lists 950PR/950DT only",
        },
    ),
}

#: per-SoC deviations from the generation's numbers
SOC_OVERRIDES: dict[str, dict[str, Any]] = {
    "Ascend910B4": {
        "memory_bytes": 32 * GIB, "cube_cores": 20, "vector_cores": 40,
        "peak_flops": {"float16": 20 * 1.5e9 * 4096 * 2, "bfloat16": 20 * 1.5e9 * 4096 * 2},
        "source": _PLATFORM_CFG_3P + ": Ascend910B4.ini ai_core_cnt=20, vector_core_cnt=40, cube_freq=1500, memory_size=34359738368",
    },
}

#: torch_npu's SocVersion enum ranges (torch_npu/csrc/core/npu/NpuVariables.h in the wheel; the same
#: ranges vllm-ascend's device-type check uses: 220-225 A2, 250-255 A3, 260 Ascend950)
SOC_VERSION_RANGES = {"A2": range(220, 226), "A3": range(250, 257), "950": range(260, 261)}


def generation_of(soc_name: str) -> Generation:
    """``"Ascend950PR_9589"`` → 950PR, ``"Ascend910B2"`` → A2, ``"Ascend910_9392"`` → A3.

    A bare ``"Ascend950"`` (no PR/DT suffix) is refused: its memory system is unknown, and guessing
    would put a wrong roofline into every report.
    """
    for gen in GENERATIONS.values():
        if any(soc_name.startswith(p) for p in gen.soc_prefixes):
            return gen
    raise ValueError(
        f"unknown Ascend SoC {soc_name!r}: known prefixes are "
        + ", ".join(p for g in GENERATIONS.values() for p in g.soc_prefixes)
    )


# cache.kv_dtype: FP8 KV records (kv_dtype:fp8) only where the quantised operators exist (the 950:
# kv_compress_epilog writes and npu_kv_quant_sparse_attn_sharedkv reads DeepSeek-V4's 640-byte record; the
# storage pages the core's 584-byte fp8_ds_mla records in that arrangement, see kv_quant.py). A2/A3 have no
# operator that reads FP8 records and no generation has one for FP4 (NVFP4/MXFP4) records: those values are
# refused at start-up (cache.kv_dtype, by formats.check_backend) instead of running every KV op on the reference
FEATURES_ALL = frozenset({"paged_attention", "fused_moe_routing", "grouped_gemm", "mc2_dispatch_combine",
                          "hash_routing_table"})
DTYPES = frozenset({"float16", "bfloat16", "float32", "int8"})


def profile_for(soc_name: str, device_index: int = 0, memory_bytes: int | None = None) -> DeviceProfile:
    """The :class:`DeviceProfile` of one NPU, from its SoC name; ``exec_level`` is ``wired-unrun``
    until this backend's ops have run on hardware (qualification raises it per op, not this profile)."""
    gen = generation_of(soc_name)
    vals: dict[str, Any] = {k: getattr(gen, k) for k in ("memory_bytes", "peak_flops", "cube_cores", "vector_cores")}
    sources = dict(gen.sources)
    if soc_name in SOC_OVERRIDES:
        ov = dict(SOC_OVERRIDES[soc_name])
        src = ov.pop("source")
        vals.update(ov)
        for k in ov:
            sources[k] = src
    if memory_bytes:
        vals["memory_bytes"] = memory_bytes
        sources["memory_bytes"] = "torch.npu.get_device_properties(i).total_memory on this host"
    features = set(FEATURES_ALL)
    dtypes = set(DTYPES)
    if gen.mxfp8:
        features |= {"mxfp8", "fp8_block_linear"}
        dtypes |= {"float8_e4m3fn", "float8_e5m2"}
    if gen.mxfp4:
        features |= {"mxfp4", "fp4_grouped_gemm"}
        dtypes |= {"fp4_e2m1"}
    if not gen.name.startswith("950"):  # bf16 sparse attention over shared KV: A2/A3 (its README: not 950)
        features.add("sparse_attn_sharedkv")
    else:  # its quantised-KV variant and the MXFP8 KV write: 950PR/DT only (their READMEs / kernel config)
        features |= {"kv_quant_sparse_attn_sharedkv", "kv_dtype:fp8"}
    return DeviceProfile(
        backend="ascend950",
        device_name=f"{soc_name} ({gen.name})",
        torch_device=f"npu:{device_index}",
        exec_level=ExecLevel.WIRED_UNRUN,
        dtypes=frozenset(dtypes),
        features=frozenset(features),
        memory_bytes=int(vals["memory_bytes"]),
        peak_bandwidth=gen.peak_bandwidth,
        peak_flops=vals["peak_flops"],
        # FIA page attention: block_size 16-aligned for fp16/bf16 KV (128-multiple in the Q_S > 1 branch)
        alignment={"kv_block_tokens": 16, "kv_block_tokens_prefill": 128, "gemm_k": 16, "ub_bytes": 32},
        compute_units=int(vals["cube_cores"]),
        sources=sources,
        extra={"generation": gen.name, "soc_name": soc_name, "cube_cores": vals["cube_cores"],
               "vector_cores": vals["vector_cores"], "ub_bytes": gen.ub_bytes},
    )


#: Links per generation, per NPU and per direction (bytes/s), for the planner's EP all-to-all
#: (``inferhal plan``): ``scale_up`` reaches ``domain`` NPUs of one supernode (HCCS / UB), ``scale_out`` the rest.
LINKS: dict[str, dict[str, Any]] = {
    "950PR": {"scale_up": {"name": "HCCS/UB (Lingqu)", "bandwidth": 1.0e12, "domain": 8192},
              "scale_out": {"name": "RoCE (not published)", "bandwidth": 0.0},
              "source": _PRESS_950 + ": '2 TB/s interconnect' per chip, direction not stated: taken as bidirectional, "
                                     "1 TB/s each way - UNVERIFIED; Atlas 950 SuperPoD: 8,192 NPUs in one UB domain "
                                     "(press); no scale-out figure published (0 = unknown)"},
    "950DT": {"scale_up": {"name": "HCCS/UB (Lingqu)", "bandwidth": 1.0e12, "domain": 8192},
              "scale_out": {"name": "RoCE (not published)", "bandwidth": 0.0},
              "source": _PRESS_950 + ": 950DT '2 TB/s interconnect', as 950PR - UNVERIFIED"},
}


def catalog() -> dict[str, DeviceProfile]:
    """Each generation with published peaks (950PR, 950DT) as a profile without a device, for
    ``inferhal plan plan.device=950DT`` (the ``device_catalog`` extra); ``extra["links"]`` holds :data:`LINKS`."""
    out = {}
    for name, links in LINKS.items():
        p = profile_for(f"Ascend{name}")
        extra = {**p.extra, "links": {k: dict(v) for k, v in links.items() if k != "source"}}
        out[name] = replace(p, device_name=f"Ascend {name} (press figures)", extra=extra,
                            sources={**p.sources, "links": links["source"]})
    return out


# ------------------------------------------------------------------------------------------ probing


@dataclass(frozen=True)
class Host:
    """What the probe looks at; injectable so the probe's logic is tested without a device."""

    find_spec: Callable[[str], Any] = importlib.util.find_spec
    device_nodes: Callable[[], list[str]] = lambda: sorted(glob.glob("/dev/davinci[0-9]*"))
    environ: Mapping[str, str] = field(default_factory=lambda: os.environ)
    isdir: Callable[[str], bool] = os.path.isdir
    import_torch_npu: Callable[[], Any] = lambda: importlib.import_module("torch_npu")


def rank_index(base: int, count: Callable[[], int], host: Host) -> int:
    """The NPU of this process: ``backend.device_index`` (``base``) moved to this rank's own NPU when ranks share
    the host (``LOCAL_RANK`` in ``host.environ``: :func:`inferhal.core.parallel.launch.device_index`); a UserError
    when the host has too few NPUs (``count()``, torch.npu's) for its ranks."""
    from inferhal.core.parallel.launch import device_index

    return device_index(base, count, "NPU", host.environ)


def probe(device_index: int = 0, host: Host | None = None) -> Probe:
    """Checks, cheapest first; torch_npu is imported only when everything else is there. ``device_index`` is
    ``backend.device_index``; this rank's NPU is :func:`rank_index`'s."""
    host = host or Host()
    if host.find_spec("torch_npu") is None:
        return Probe(False, "torch_npu is not installed (pip install 'inferhal[ascend]' on a host with CANN)")
    nodes = host.device_nodes()
    if not nodes:
        return Probe(False, "torch_npu is installed but no /dev/davinci* device node exists: no Ascend NPU here")
    if not host.environ.get("ASCEND_HOME_PATH") and not host.isdir("/usr/local/Ascend"):
        return Probe(False, "no CANN toolkit found (ASCEND_HOME_PATH unset, /usr/local/Ascend absent)")
    try:
        torch_npu = host.import_torch_npu()
        npu = torch_npu.npu
        count = int(npu.device_count())
    except Exception as exc:  # libhccl/libascendcl missing, driver mismatch, ...
        return Probe(False, f"torch_npu failed to import or count devices: {type(exc).__name__}: {exc}")
    if count == 0:
        return Probe(False, f"{len(nodes)} /dev/davinci node(s) but torch.npu.device_count() == 0 (driver or visibility)")
    try:
        device_index = rank_index(device_index, lambda: count, host)
    except UserError as exc:
        return Probe(False, str(exc))
    if device_index >= count:
        return Probe(False, f"device_index {device_index} out of range: torch.npu reports {count} device(s)")
    try:
        soc = str(npu.get_device_name(device_index))
        gen = generation_of(soc)
    except Exception as exc:
        return Probe(False, f"cannot map the SoC of npu:{device_index} to a generation: {exc}")
    return Probe(True, f"{count} NPU(s), npu:{device_index} is {soc} (generation {gen.name}); not yet initialised",
                 {"device_count": count, "device_nodes": len(nodes), "soc_name": soc, "generation": gen.name})


def query_profile(device_index: int = 0, host: Host | None = None) -> DeviceProfile:
    """The profile of this rank's NPU (:func:`rank_index` of ``backend.device_index``), probed and available:
    reads the SoC name and total memory. :class:`AscendDevice` makes it the current NPU."""
    host = host or Host()
    npu = host.import_torch_npu().npu
    device_index = rank_index(device_index, npu.device_count, host)
    soc = str(npu.get_device_name(device_index))
    mem = None
    with contextlib.suppress(Exception):
        mem = int(npu.get_device_properties(device_index).total_memory)
    return profile_for(soc, device_index, mem)


# ------------------------------------------------------------------------------------------ device


class AscendDevice:
    """Streams, events and memory through ``torch.npu``; constructing it initialises the device."""

    def __init__(self, profile: DeviceProfile, torch_npu: Any = None) -> None:
        import torch

        self._npu = (torch_npu or importlib.import_module("torch_npu")).npu
        self.torch_device = torch.device(profile.torch_device)
        self._npu.set_device(self.torch_device)

    def synchronize(self) -> None:
        self._npu.synchronize()

    def stream(self):
        return self._npu.stream(self._npu.Stream())

    def event(self):
        return self._npu.Event()

    def memory_stats(self) -> dict[str, int]:
        free, total = self._npu.mem_get_info()
        return {"total": int(total), "free": int(free)}


class AscendKVStorage:
    """KV pool laid out for the fused operators: one contiguous tensor per (group, layer).

    A ``(2, Hk, D)`` slot (separate K and V) is allocated as two planes ``[2, NB, BS, Hk, D]`` and
    handed out as the permuted view ``[NB, BS, 2, Hk, D]``: the logical layout of the op vocabulary,
    while ``cache[:, :, 0]`` and ``cache[:, :, 1]`` are each contiguous ``(blocknum, blocksize, Hk, D)``
    tensors, as ``npu_fused_infer_attention_score`` (page attention, ``(blocknum, blocksize, H)``) and
    ``npu_scatter_pa_kv_cache`` (``cache_mode='Norm'``) require ("不支持非连续"). With ``operator_records``
    (the 950) a 584-byte uint8 slot (an FP8 ``fp8_ds_mla`` record of a 512-dim latent) gets a 640-byte row and
    is handed out as its first 584 bytes, in the quantised operators' byte order (:mod:`.kv_quant`); ``nbytes``
    counts the whole rows. Other slots are plain contiguous ``[NB, BS, *slot]``, ``NB`` being the group's own
    pool (``request.blocks_of(group)``).
    """

    def __init__(self, request: Any, device: str, operator_records: bool = False) -> None:
        import torch

        from inferhal.backends.ascend950 import kv_quant

        self.request = request
        self._caches: dict[tuple[str, int], torch.Tensor] = {}
        self._bytes = 0
        for g in request.groups:
            nb = request.blocks_of(g)
            for layer in g.layers:
                if len(g.slot_shape) == 3 and g.slot_shape[0] == 2:
                    planes = torch.zeros((2, nb, g.slots_per_block, *g.slot_shape[1:]), dtype=g.dtype, device=device)
                    cache = planes.permute(1, 2, 0, 3, 4)
                elif operator_records and g.dtype == torch.uint8 and tuple(g.slot_shape) == (kv_quant.CORE_ROW,):
                    # FP8 main records in the quantised operators' 640-byte rows (kv_quant.py)
                    rows = torch.zeros((nb, g.slots_per_block, kv_quant.ROW), dtype=g.dtype, device=device)
                    cache = rows[:, :, :kv_quant.CORE_ROW]
                    self._bytes += rows.numel() - cache.numel()
                else:
                    cache = torch.zeros((nb, g.slots_per_block, *g.slot_shape), dtype=g.dtype, device=device)
                self._caches[(g.name, layer)] = cache
                self._bytes += cache.numel() * cache.element_size()

    def layer_cache(self, group: str, layer: int):
        try:
            return self._caches[(group, layer)]
        except KeyError:
            raise KeyError(f"no KV cache for layer {layer} in group {group!r}") from None

    def nbytes(self) -> int:
        return self._bytes
