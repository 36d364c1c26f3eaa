"""Backend discovery (entry points), validation, probing and selection (exactly one active).

>>> reg = BackendRegistry.discover()
>>> active = reg.select(BackendConfig(name="reference"))
>>> active.ops["norm.rms"]
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

import pluggy

from inferhal.core import hookspecs
from inferhal.core.config.schema import BackendConfig
from inferhal.core.errors import UserError
from inferhal.core.ops.invariance import UNDECLARED, BatchInvariance, check_declarations
from inferhal.core.ops.table import OpTable
from inferhal.core.ops.vocabulary import OPS
from inferhal.core.profile import DeviceProfile, ExecLevel, Probe

log = logging.getLogger("inferhal.registry")

ENTRY_POINT_GROUP = hookspecs.ENTRY_POINT_GROUP
REFERENCE = "reference"


class BackendSelectionError(UserError, RuntimeError):
    """The requested backend is unknown, unavailable or invalid. The message lists every backend found.

    A :class:`~inferhal.core.errors.UserError` (the CLI prints it and exits 2, no traceback); still a
    ``RuntimeError`` for callers that catch it as one."""


@dataclass
class BackendRecord:
    """One discovered backend: its plugin object, or why it could not be registered."""

    name: str
    plugin: Any = None
    origin: str = ""
    error: str = ""  # registration problem (import failure, API version, missing hook, unknown hook)

    @property
    def registered(self) -> bool:
        return self.plugin is not None and not self.error


@dataclass
class ActiveBackend:
    """The one selected backend: its profile, device, ops and hook callers for the rest of the contract."""

    name: str
    config: BackendConfig
    profile: DeviceProfile
    device: Any
    ops: OpTable
    _registry: "BackendRegistry" = field(repr=False)

    def call(self, hook: str, /, **kwargs: Any) -> Any:
        return self._registry.call(self.name, hook, **kwargs)

    def kv_storage(self, request: Any) -> Any:
        return self.call("inferhal_kv_storage", request=request, profile=self.profile)

    def communicator(self, layout: Any) -> Any:
        return self.call("inferhal_communicator", layout=layout, profile=self.profile)

    def kv_connector(self, peer: int, group: Any = None) -> Any:
        """The backend's KV connector to rank ``peer`` (prefill/decode disaggregation), or None: it has none
        (:func:`inferhal.core.disagg.connector.connect` then takes torch.distributed point-to-point)."""
        return self.call("inferhal_kv_connector", peer=peer, group=group, profile=self.profile)

    def graph_runner(self) -> Any:
        return self.call("inferhal_graph_runner", profile=self.profile, config=self.config)

    def batch_invariant_twin(self) -> "ActiveBackend":
        """This backend selected again with batch-invariant ops (what ``deterministic=true`` runs), or a
        :class:`BackendSelectionError` naming the ops that cannot honour it."""
        if self.config.batch_invariant:
            return self
        self._registry.check_deterministic(self.config)
        return self._registry.select(dataclasses.replace(self.config, batch_invariant=True))

    def batch_invariance(self) -> "dict[str, BatchInvariance] | None":
        """op ID -> this backend's declared batch invariance (``None``: it declares none per op)."""
        return self._registry.op_batch_invariance(self.name)

    def extra(self, name: str) -> Any:
        value = self.call("inferhal_backend_extra", name=name, profile=self.profile)
        if value is None:
            raise KeyError(f"backend {self.name!r} provides no extra named {name!r}")
        return value


class BackendRegistry:
    """All backends found, each validated against :mod:`inferhal.core.hookspecs`."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.records: dict[str, BackendRecord] = {}
        self._probes: dict[tuple, Probe] = {}

    # ---------------------------------------------------------------- discovery and registration

    @classmethod
    def discover(cls, extra: Mapping[str, Any] | None = None) -> "BackendRegistry":
        """Load every entry point of group ``inferhal.backends`` (and ``extra`` plugins, for tests)."""
        reg = cls()
        for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if ep.name in reg.records:
                reg.records[ep.name].error = (
                    f"two entry points named {ep.name!r} ({reg.records[ep.name].origin} and {ep.value}); "
                    f"uninstall one"
                )
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # an uninstallable/broken plugin must not break the others
                reg.records[ep.name] = BackendRecord(ep.name, None, ep.value, f"import failed: {type(exc).__name__}: {exc}")
                continue
            reg.register(ep.name, plugin, origin=ep.value)
        for name, plugin in (extra or {}).items():
            reg.register(name, plugin, origin=f"registered in-process ({getattr(plugin, '__name__', type(plugin).__name__)})")
        return reg

    def register(self, name: str, plugin: Any, origin: str = "") -> BackendRecord:
        if name in self.records and self.records[name].registered:
            raise BackendSelectionError(f"a backend named {name!r} is already registered ({self.records[name].origin})")
        rec = BackendRecord(name, plugin, origin)
        self.records[name] = rec
        try:
            self.pm.register(plugin, name=name)
        except (pluggy.PluginValidationError, ValueError) as exc:
            rec.error = f"invalid plugin: {exc}"
            return rec
        rec.error = self._validate(name, plugin)
        if rec.error:
            self.pm.unregister(name=name)
        return rec

    def _validate(self, name: str, plugin: Any) -> str:
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            return f"invalid plugin: {exc}"
        missing = [h for h in hookspecs.REQUIRED_HOOKS if not self._implements(name, h)]
        if missing:
            return f"missing required hooks: {', '.join(missing)}"
        version = self.call(name, "inferhal_api_version")
        if version != hookspecs.API_VERSION:
            return f"written for contract API version {version}, this inferhal speaks version {hookspecs.API_VERSION}"
        return ""

    def _implements(self, name: str, hook: str) -> bool:
        return any(impl.plugin_name == name for impl in getattr(self.pm.hook, hook).get_hookimpls())

    def call(self, backend: str, hook: str, /, **kwargs: Any) -> Any:
        """Call ``hook`` on backend ``backend`` only (positional, so a hook argument may be called ``name``)."""
        others = [p for n, p in self.pm.list_name_plugin() if n != backend]
        return self.pm.subset_hook_caller(hook, remove_plugins=others)(**kwargs)

    def extra(self, name: str, extra: str, /) -> Any:
        """A backend's named extra without selecting it (no device is touched): e.g. the ahead-of-time
        compiler, which works on a machine without the device. ``None`` when not provided."""
        if name not in self.records or not self.records[name].registered:
            return None
        return self.call(name, "inferhal_backend_extra", name=extra, profile=None)

    # ---------------------------------------------------------------- probing

    def names(self) -> list[str]:
        return sorted(self.records)

    def probe(self, name: str, config: BackendConfig | None = None) -> Probe:
        rec = self.records[name]
        if not rec.registered:
            return Probe(False, rec.error)
        config = config or BackendConfig(name=name)
        key = (name, config.interpret, config.device_index)
        if key not in self._probes:
            try:
                probe = self.call(name, "inferhal_probe", config=config)
            except Exception as exc:  # a probe that raises is a broken probe, reported as such
                probe = Probe(False, f"probe raised {type(exc).__name__}: {exc}")
            if not isinstance(probe, Probe):
                probe = Probe(False, f"probe returned {type(probe).__name__}, not a Probe")
            self._probes[key] = probe
        return self._probes[key]

    def probe_all(self) -> dict[str, Probe]:
        return {name: self.probe(name) for name in self.names()}

    def describe(self) -> str:
        """One line per backend found: name, available or not, and why."""
        lines = []
        for name, probe in self.probe_all().items():
            state = "available" if probe.available else "unavailable"
            lines.append(f"  {name:<14} {state:<12} {probe.reason}")
        return "\n".join(lines) if lines else "  (no backends found in entry-point group inferhal.backends)"

    # ---------------------------------------------------------------- selection

    def require(self, config: BackendConfig) -> None:
        """Raise :class:`BackendSelectionError` unless ``config.name`` is found and available here, as
        :meth:`select` would, but by probing only (no device is initialised): a launcher checks this
        before it starts any process."""
        name = config.name
        if name not in self.records:
            import difflib

            close = difflib.get_close_matches(name, self.names(), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise BackendSelectionError(f"unknown backend {name!r}.{hint} Backends found:\n{self.describe()}")
        probe = self.probe(name, config)
        if not probe.available:
            raise BackendSelectionError(f"backend {name!r} is unavailable: {probe.reason}\nBackends found:\n{self.describe()}")

    # ---------------------------------------------------------------- batch invariance (capability data per op)

    def op_batch_invariance(self, name: str) -> dict[str, BatchInvariance] | None:
        """op ID → what backend ``name`` declares about its batch invariance (``inferhal_op_batch_invariance``,
        no probing); ``None`` when it declares nothing per op. A malformed declaration is a selection error."""
        if name not in self.records or not self.records[name].registered:
            return None
        declared = self.call(name, "inferhal_op_batch_invariance")
        if declared is None:
            return None
        try:
            return check_declarations(name, declared)
        except (TypeError, KeyError, ValueError) as exc:
            raise BackendSelectionError(f"backend {name!r} declares batch invariance wrongly: {exc}") from None

    def batch_variant_ops(self, name: str, natives: list[str], profile_claims: bool = False) -> dict[str, str]:
        """Of the ops backend ``name`` runs itself (``natives``), those that cannot honour batch invariance, each
        with why. Without per-op declarations the profile's ``batch_invariant`` feature (``profile_claims``,
        asked with the mode on) stands for every op."""
        declared = self.op_batch_invariance(name)
        if declared is None:
            why = ("the backend declares no batch invariance per op, and its profile does not claim the "
                   "'batch_invariant' feature")
            return {} if profile_claims else {op: why for op in natives}
        return {op: declared.get(op, UNDECLARED).why for op in natives if not declared.get(op, UNDECLARED).holds(True)}

    def check_deterministic(self, config: BackendConfig) -> None:
        """Refuse ``deterministic=true`` where backend ``config.name`` cannot honour it: every op it runs itself
        must declare batch invariance (``inferhal_op_batch_invariance``); the refusal names each op that does
        not, with its reason (a row's result from any of them may change with the batch it shares). The
        reference's fallbacks run in its batch-invariant mode, which honours it."""
        name = config.name
        self.require(config)
        natives = self.select(dataclasses.replace(config, batch_invariant=False, strict=False)).ops.natives()
        claims = False
        if self.op_batch_invariance(name) is None:  # no per-op data: the profile's claim, asked with the mode on
            try:
                claims = self.call(name, "inferhal_device_profile", config=dataclasses.replace(
                    config, batch_invariant=True)).supports("batch_invariant")
            except UserError:  # the backend refuses batch-invariant mode outright
                claims = False
        variant = self.batch_variant_ops(name, natives, claims)
        if variant:
            raise BackendSelectionError(f"deterministic=true: backend {name!r} cannot honour it: "
                                        f"{_name_ops(variant)}; backend=reference honours it")

    def select(self, config: BackendConfig) -> ActiveBackend:
        """Make ``config.name`` the active backend; fail with every backend found and why."""
        name = config.name
        self.require(config)
        profile = self.call(name, "inferhal_device_profile", config=config)
        if config.interpret and profile.exec_level != ExecLevel.INTERPRETER:
            raise BackendSelectionError(f"backend.interpret=true: backend {name!r} has no interpreter mode (its ops run at "
                                        f"level {profile.exec_level.value!r}); leave backend.interpret=false")
        declared = self.op_batch_invariance(name)
        if config.batch_invariant and declared is None and not profile.supports("batch_invariant"):
            raise BackendSelectionError(f"backend.batch_invariant=true: backend {name!r} does not declare batch-invariant "
                                        f"ops (no per-op declarations, and its profile lacks the 'batch_invariant' "
                                        f"feature)")
        native = dict(self.call(name, "inferhal_provide_ops", profile=profile, config=config) or {})
        if config.batch_invariant and declared is not None:
            variant = self.batch_variant_ops(name, [op for op in OPS if op in native])
            if variant:
                raise BackendSelectionError(f"backend.batch_invariant=true: backend {name!r} cannot honour it: "
                                            f"{_name_ops(variant)}")
            # every op it runs declares invariance: the mode is on (the ops and qualify read the feature)
            profile = dataclasses.replace(profile, features=profile.features | {"batch_invariant"})
        fallback: Mapping[str, Any] = {}
        if name != REFERENCE:
            if REFERENCE not in self.records or not self.probe(REFERENCE).available:
                raise BackendSelectionError(f"the reference backend, which provides fallbacks, is missing:\n{self.describe()}")
            ref_cfg = BackendConfig(name=REFERENCE, batch_invariant=config.batch_invariant)  # fallbacks honour it too
            ref_profile = self.call(REFERENCE, "inferhal_device_profile", config=ref_cfg)
            fallback = self.call(REFERENCE, "inferhal_provide_ops", profile=ref_profile, config=config) or {}
        try:
            ops = OpTable(name, native, fallback, profile.exec_level, strict=config.strict)
        except KeyError as exc:
            raise BackendSelectionError(f"backend {name!r} provides an op outside the vocabulary: {exc}") from None
        device = self.call(name, "inferhal_device", profile=profile, config=config)
        return ActiveBackend(name, config, profile, device, ops, self)

    def coverage(self) -> dict[str, dict[str, str]]:
        """backend → op ID → execution level (or ``fallback`` / ``absent``): the ``inferhal backends`` matrix.

        Uses each backend's ``inferhal_declared_ops`` (no probing, so it works for unavailable backends too),
        falling back to constructing the op table of an available backend that declares nothing.
        """
        ref = set(self.declared_ops(REFERENCE)) if REFERENCE in self.records else set()
        out: dict[str, dict[str, str]] = {}
        for name in self.names():
            if not self.records[name].registered:
                continue
            declared = self.declared_ops(name)
            row = {}
            for op_id in OPS:
                if op_id in declared:
                    row[op_id] = declared[op_id]
                elif op_id in ref:
                    row[op_id] = ExecLevel.FALLBACK.value
                else:
                    row[op_id] = "absent"
            out[name] = row
        return out

    def invariance_matrix(self) -> dict[str, dict[str, dict[str, str]]]:
        """backend → op ID → ``{"state", "why"}`` for the ops the coverage matrix lists as the backend's own:
        state ``always`` / ``in mode`` (with ``backend.batch_invariant=true`` only) / ``no`` / ``undeclared``;
        a reference fallback is ``fallback`` (the reference's batch-invariant op runs in the mode). No probing."""
        out: dict[str, dict[str, dict[str, str]]] = {}
        for name, row in self.coverage().items():
            try:
                declared = self.op_batch_invariance(name)
            except BackendSelectionError as exc:  # one malformed plugin must not hide the others
                out[name] = {op: {"state": "invalid", "why": str(exc)} for op, lvl in row.items() if lvl != "absent"}
                continue
            cells = {}
            for op_id, level in row.items():
                if level == "absent":
                    continue
                if level == ExecLevel.FALLBACK.value:
                    cells[op_id] = {"state": "fallback", "why": "the reference's op stands in (batch invariant in its "
                                                                 "batch-invariant mode)"}
                elif declared is None:
                    cells[op_id] = {"state": "undeclared", "why": "no per-op declaration; the profile's "
                                                                   "'batch_invariant' feature decides for every op"}
                else:
                    d = declared.get(op_id, UNDECLARED)
                    cells[op_id] = {"state": d.state, "why": d.why}
            out[name] = cells
        return out

    def declared_ops(self, name: str) -> dict[str, str]:
        declared = self.call(name, "inferhal_declared_ops")
        if declared is None:
            probe = self.probe(name)
            if not probe.available:
                return {}
            cfg = BackendConfig(name=name)
            profile = self.call(name, "inferhal_device_profile", config=cfg)
            native = self.call(name, "inferhal_provide_ops", profile=profile, config=cfg) or {}
            return {op: ExecLevel(getattr(fn, "level", None) or profile.exec_level).value for op, fn in native.items()}
        return {op: ExecLevel(level).value for op, level in declared.items()}


def _name_ops(variant: Mapping[str, str]) -> str:
    """``op (why); op (why)``, grouped by reason so a long list stays readable."""
    by_why: dict[str, list[str]] = {}
    for op, why in variant.items():
        by_why.setdefault(why, []).append(op)
    ops = "; ".join(f"{', '.join(ops)} ({why})" for why, ops in by_why.items())
    return f"its op{'s' if len(variant) > 1 else ''} {ops} declare{'s' if len(variant) == 1 else ''} no batch invariance"
