"""The whole backend contract of inferhal, as pluggy hook specifications.

A backend is a module (or object) of ``@hookimpl`` functions, registered through the entry-point
group ``inferhal.backends``; the entry-point name is the backend name used in ``backend=NAME``.
The in-tree backends under ``backends/`` register exactly that way.

The registry calls every hook on *one* backend at a time (pluggy's ``subset_hook_caller``), so each
hook sees only its own implementation. Hooks construct; the typed objects they return do the work
(see :mod:`inferhal.core.backend` for the Protocols). pluggy lets an implementation accept fewer
arguments than its spec, so this contract can grow without breaking a backend; the registry runs
``check_pending()`` so that an implementation matching no spec is an error, not a silent no-op.

Hooks marked *required* must be implemented; the registry refuses a backend without them. A backend
that implements an optional hook returns ``None`` to mean "not provided".

Importing this module imports no device library; nor may any hook implementation at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import pluggy

if TYPE_CHECKING:  # pragma: no cover - names for the docstrings and type checkers only
    from inferhal.core.backend import Communicator, Device, GraphRunner, KVStorage
    from inferhal.core.config.schema import BackendConfig
    from inferhal.core.ops.invariance import BatchInvariance
    from inferhal.core.ops.table import OpImpl
    from inferhal.core.profile import DeviceProfile, Probe
    from inferhal.core.backend import KVStorageRequest, ParallelLayout
    from inferhal.core.paging.offload import KVBlockCopier

PROJECT = "inferhal"
#: The entry-point group a backend package registers its plugin module under (``pyproject.toml``:
#: ``[project.entry-points."inferhal.backends"] NAME = "package.plugin"``).
ENTRY_POINT_GROUP = "inferhal.backends"

#: The version of this contract. A backend declares the version it was written against through
#: :func:`inferhal_api_version`; the registry refuses a different major version with a clear message.
API_VERSION = 1

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --------------------------------------------------------------------------------------------------
# Registration and probing
# --------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def inferhal_api_version() -> int:
    """*Required.* Return the :data:`API_VERSION` this backend was written against.

    Checked once at registration; a mismatch makes the backend unavailable with a reason that names
    both versions. firstresult.
    """


@hookspec(firstresult=True)
def inferhal_probe(config: "BackendConfig") -> "Probe":
    """*Required.* Say whether this backend can run here, without side effects.

    :param config: the ``backend`` config group; e.g. ``interpret=true`` lets a kernel backend run in
        its interpreter on a machine without its device.

    Return a :class:`~inferhal.core.profile.Probe` (``available``, a one-line ``reason`` that a user
    can act on, and optional ``details`` such as the driver version or the device count).

    Must not initialise a device, create a context, allocate memory or spawn a process: it is called
    for every installed backend by ``inferhal backends`` and by every failed selection. Catch the
    import and driver errors of the device stack and turn them into ``available=False`` with the
    reason. firstresult.
    """


# --------------------------------------------------------------------------------------------------
# Capability data
# --------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def inferhal_device_profile(config: "BackendConfig") -> "DeviceProfile":
    """*Required.* Describe the device this backend will run on, as data.

    :param config: the ``backend`` config group (``name``, ``strict``, ``interpret``, ``device_index``,
        ``options``).
    :returns: a :class:`~inferhal.core.profile.DeviceProfile`: the torch device string, supported
        dtypes, feature names (e.g. ``fp4_grouped_gemm``, ``paged_sparse_attention``), memory capacity,
        peak memory bandwidth, peak FLOP/s per dtype, alignment rules, and the execution level its
        native ops run at (``device``, ``interpreter``, ``compiled``, ``wired-unrun``).

    Only called on an available backend. Core and model code ask this profile for capabilities,
    never for chip names. firstresult.
    """


@hookspec(firstresult=True)
def inferhal_device(profile: "DeviceProfile", config: "BackendConfig") -> "Device":
    """*Required.* Construct the runtime device object: streams, events, synchronisation, memory stats.

    Streams and events are obtained only through the returned
    :class:`~inferhal.core.backend.Device`; core code never calls a device library directly.
    This is the first hook allowed to initialise the device. firstresult.
    """


# --------------------------------------------------------------------------------------------------
# Ops
# --------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def inferhal_provide_ops(profile: "DeviceProfile", config: "BackendConfig") -> "Mapping[str, OpImpl]":
    """*Required.* Return the ops this backend implements natively, by op ID.

    :returns: a mapping from op IDs of :mod:`inferhal.core.ops.vocabulary` (e.g. ``"norm.rms"``) to
        callables with the signature documented there for that ID. An unknown op ID is an error at
        selection. An op may be wrapped in :class:`~inferhal.core.ops.table.OpImpl` to state its
        execution level when it differs from the profile's (e.g. one op compiled, another fallback).
        An op that hands some calls to the reference itself (outside a device operator's limits) gives
        its implementation a ``fallback_log`` list (best a :class:`~inferhal.core.ops.table.FallbackLog`,
        which stays bounded in a long-running server) and appends ``(op_id, reason)`` per such call:
        ``inferhal qualify`` then reports those cases at level ``fallback``, not at the op's level.

    Ops left out fall back to the ``reference`` backend's implementation, visibly: ``inferhal
    backends`` prints the coverage matrix, a warning is logged once per op, and
    ``backend.strict=true`` turns a fallback into an error. firstresult.
    """


@hookspec(firstresult=True)
def inferhal_declared_ops() -> "Mapping[str, str] | None":
    """*Optional.* The ops this backend implements and the execution level each would run at, as data,
    without probing or touching a device (``{"norm.rms": "device", "attn.paged": "wired-unrun"}``).

    Lets ``inferhal backends`` print the coverage matrix for a backend that is unavailable here.
    ``None`` means "ask :func:`inferhal_provide_ops` when available". firstresult.
    """


@hookspec(firstresult=True)
def inferhal_op_batch_invariance() -> "Mapping[str, BatchInvariance] | None":
    """*Optional.* Each op's batch invariance, as data, without probing or touching a device: op ID →
    :class:`~inferhal.core.ops.invariance.BatchInvariance` (invariant or not, why, and whether only in the
    backend's batch-invariant mode, ``backend.batch_invariant=true``).

    ``deterministic=true`` and ``backend.batch_invariant=true`` are refused at start-up, naming each op the
    backend runs itself that does not declare invariance (with its reason); ``inferhal qualify`` checks the
    declared ones bitwise; ``inferhal backends`` prints the table. ``None``: the backend declares nothing per
    op, and its profile's ``batch_invariant`` feature (asked with ``backend.batch_invariant=true``) stands for
    every op it provides. firstresult.
    """


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def inferhal_kv_storage(request: "KVStorageRequest", profile: "DeviceProfile") -> "KVStorage":
    """*Required.* Allocate the backing memory of the paged KV block pool.

    :param request: a :class:`~inferhal.core.backend.KVStorageRequest`: number of blocks, block size
        in tokens, and one :class:`~inferhal.core.backend.KVGroupLayout` per layer group (slot shape,
        dtype, layers). All groups share one pool of ``num_blocks`` blocks.
    :returns: a :class:`~inferhal.core.backend.KVStorage` whose ``layer_cache(group, layer)`` returns
        a tensor of shape ``[num_blocks, slots_per_block, *slot_shape]`` on the device. firstresult.
    """


@hookspec(firstresult=True)
def inferhal_kv_block_copier(storage: "KVStorage", profile: "DeviceProfile") -> "KVBlockCopier | None":
    """*Optional.* Copy whole KV blocks between ``storage`` (this backend's :func:`inferhal_kv_storage`) and host
    memory, for the tiers behind the prefix cache (``cache.host_tier_bytes``, ``cache.disk_tier_dir``).

    :returns: a :class:`~inferhal.core.paging.offload.KVBlockCopier`: ``gather(group, layers, block_ids)`` gives
        one host tensor per block, ``[len(layers), slots_per_block, *slot_shape]`` in the storage dtype (quantised
        records stay ``uint8`` records), owned by the caller once it returns; ``scatter(group, layers, block_ids,
        blocks)`` writes such tensors back, before any later step reads those blocks. ``scatter`` is called on the
        thread that runs steps, between steps; ``gather`` on the tiers' copy worker (core/paging/copy_worker.py)
        while later steps run, for blocks no step writes until it returns (pinned, core/paging/pending.py) and
        written by steps already submitted. A device backend copies with its own engine (pinned buffers, a side
        stream: ``gather`` waits for the compute stream's work queued so far, ``scatter`` is ordered before the
        next step). ``None``: the engine copies with plain torch
        (:class:`~inferhal.core.paging.offload.TorchBlockCopier`, any torch device). firstresult.
    """


# --------------------------------------------------------------------------------------------------
# Communication
# --------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def inferhal_communicator(layout: "ParallelLayout", profile: "DeviceProfile") -> "Communicator":
    """*Required.* Construct the communicator for this rank: a torch.distributed process group and
    the collectives the engine needs (all-reduce for TP, all-to-all / dispatch-combine for EP,
    all-gather, barrier).

    :param layout: a :class:`~inferhal.core.backend.ParallelLayout` (world size, rank, tp, ep, dp,
        the rendezvous address). With ``world_size == 1`` return a communicator whose collectives
        are identities; no process group is created. firstresult.
    """


@hookspec(firstresult=True)
def inferhal_kv_connector(peer: int, group: Any, profile: "DeviceProfile") -> Any:
    """*Optional.* A KV connector (:class:`~inferhal.core.disagg.connector.KVConnector`: ``handshake``,
    ``send``, ``recv``, ``close``) that moves requests' KV blocks and state from a prefill instance to a
    decode instance (prefill/decode disaggregation), to rank ``peer`` of the torch.distributed ``group``
    (``None``: the default group; in served disaggregation, the 2-rank gloo group of one prefill/decode pair,
    not registered with torch.distributed: :func:`~inferhal.core.disagg.link.pair_group`, prefill rank 0,
    decode rank 1). Return ``None`` for the default transport, torch.distributed
    point-to-point send/recv (:class:`~inferhal.core.disagg.connector.TorchDistConnector`); a backend
    returns its own for a faster path (NIXL, Mooncake, RDMA). Blocks travel in their stored format
    (quantised records stay records). firstresult.
    """


# --------------------------------------------------------------------------------------------------
# Graphs
# --------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def inferhal_graph_runner(profile: "DeviceProfile", config: "BackendConfig") -> "GraphRunner | None":
    """*Optional.* Return a :class:`~inferhal.core.backend.GraphRunner` that captures and replays a
    step (e.g. device graphs), or ``None`` when the backend has no graphs; the engine then runs eagerly.
    firstresult.
    """


# --------------------------------------------------------------------------------------------------
# Escape hatch
# --------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def inferhal_backend_extra(name: str, profile: "DeviceProfile") -> Any:
    """*Optional.* Named lookup for backend-specific extras that the contract does not cover.

    Core and models never depend on an extra; tools and tests may (e.g. a recorder of device-operator
    calls). ``profile`` is ``None`` when the lookup happens without selecting the backend
    (:meth:`BackendRegistry.extra <inferhal.core.registry.BackendRegistry.extra>`); such extras must not
    touch a device. Extras with a meaning in core:

    - ``"aot_compiler"``: an object with ``targets`` (names accepted by ``inferhal kernels compile
      target=NAME``) and ``compile(target) -> list[dict]``, one row per kernel: ``kernel``, ``op``,
      ``compiled`` (bool), ``error``, ``registers``, ``spill_stack_bytes``, ``shared_bytes``,
      ``tmem_columns``, ``mma`` (the matrix-instruction family found in the assembly, as text) and
      ``mma_ok`` (the kernel needs tensor-core instructions and has them, or does not need them); optionally
      ``local_loads`` / ``local_stores``, the local-memory instructions in its assembly (what a spill costs).
    - ``"environment"``: a mapping of name → version or description (strings) of the toolchain and driver
      the backend runs on, read without touching a device (package metadata, files): ``inferhal qualify``
      puts it in its report's environment manifest.
    - ``"device_catalog"``: a mapping of device name → :class:`~inferhal.core.profile.DeviceProfile` for
      devices this backend has data for but that need not be present (datasheet numbers, each with its
      ``sources``; interconnect in ``extra["links"]``: ``scale_up``/``scale_out`` → ``name``, ``bandwidth``
      bytes/s per direction, ``domain``). ``inferhal plan plan.device=NAME`` plans with it.
    - ``"benchmarks"``: a mapping of benchmark name → importable module name, each module with
      ``run(cfg) -> int``: ``inferhal bench NAME`` runs it beside core's own (a bench of one backend lives
      with that backend; core imports none). A name core already uses is refused.
    - ``"op_variants"``: a mapping of op ID → {variant name → callable with the op's signature}: other
      implementations of an op beside the one its op table runs (e.g. an old and a new kernel, a different
      tile choice). The device run (:mod:`inferhal.core.qualify.device_run`) checks each against the reference
      and times each on the same inputs as the op table's.

    Return ``None``
    for an unknown name; :meth:`ActiveBackend.extra <inferhal.core.registry.ActiveBackend.extra>`
    turns that into a ``KeyError`` that names the backend. firstresult.
    """


REQUIRED_HOOKS = (
    "inferhal_api_version",
    "inferhal_probe",
    "inferhal_device_profile",
    "inferhal_device",
    "inferhal_provide_ops",
    "inferhal_kv_storage",
    "inferhal_communicator",
)
