"""The backend developer kit as a pytest plugin: ``pytest --inferhal-backend=NAME``.

Options:

- ``--inferhal-backend=NAME[:interpret][:strict]`` (repeatable, or comma-separated): the installed
  backend(s) to test; ``:interpret`` sets ``backend.interpret=true``, ``:strict`` sets ``backend.strict``.
  Without the option, the ``pytest_inferhal_default_backends`` hook (e.g. in a conftest) decides, else
  ``reference``.
- ``--inferhal-level=quick|full``: the case sweep (default ``quick``).
- ``--inferhal-reruns=N``: determinism reruns per case (default 2; 1 for a backend in a kernel interpreter, which runs
  each program serially on the CPU: a second rerun there repeats the first).

Fixtures: ``inferhal_backend`` (the :class:`~inferhal.core.registry.ActiveBackend` under test),
``inferhal_reference`` (the oracle), ``inferhal_case`` (an :class:`~inferhal.core.qualify.cases.OpCase`
of an op the backend claims). Tests that use ``inferhal_case`` are parametrized over every backend and
every case of every op it claims (ids ``NAME-op[shape dtype]``).

When ``--inferhal-backend`` is given and pytest found no test paths of its own (no arguments and no
``testpaths``), the kit's suite (:mod:`inferhal.core.qualify.conformance`) is collected, so a backend
package needs no test files to run it. Backends are selected at configure time, before test modules
load, so a backend that must prepare its process (an interpreter switch) does it first.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class BackendSpec:
    name: str
    interpret: bool = False
    strict: bool = False
    explicit: bool = False

    @classmethod
    def parse(cls, text: str, explicit: bool) -> "BackendSpec":
        name, *flags = text.strip().split(":")
        bad = [f for f in flags if f not in ("interpret", "strict")]
        if not name or bad:
            raise pytest.UsageError(f"--inferhal-backend={text!r}: expected NAME[:interpret][:strict], bad part {bad}")
        return cls(name, "interpret" in flags, "strict" in flags, explicit)

    @property
    def id(self) -> str:
        return self.name + ("-interpret" if self.interpret else "") + ("-strict" if self.strict else "")


class _Hooks:
    @pytest.hookspec(firstresult=True)
    def pytest_inferhal_default_backends(self, config):
        """Return the backend specs (``["reference", "NAME:interpret"]``) to test when no
        ``--inferhal-backend`` option is given."""


def pytest_addhooks(pluginmanager):
    pluginmanager.add_hookspecs(_Hooks)


def pytest_addoption(parser):
    g = parser.getgroup("inferhal", "inferhal backend conformance kit")
    g.addoption("--inferhal-backend", action="append", default=[], metavar="NAME[:interpret][:strict]",
                help="installed backend(s) to run the conformance suite against (repeatable)")
    g.addoption("--inferhal-level", default="quick", choices=("quick", "full"), help="case sweep (default quick)")
    g.addoption("--inferhal-reruns", type=int, default=None,
                help="determinism reruns per case (default 2; 1 in a kernel interpreter)")


class KitState:
    """Per-session: the selected backends (or why one could not be selected) and the oracle."""

    def __init__(self, config) -> None:
        raw = [s for opt in config.getoption("inferhal_backend") for s in opt.split(",") if s.strip()]
        self.config = config
        self.specs = [BackendSpec.parse(s, True) for s in raw]
        self.level = config.getoption("inferhal_level")
        self.reruns = config.getoption("inferhal_reruns")  # None: DEFAULT_RERUNS, by execution level
        self.registry = None
        self.active: dict[str, object] = {}
        self.errors: dict[str, str] = {}
        self.reference = None

    def ensure_selected(self) -> "KitState":
        """Select the backends once: at configure time when named on the command line, else when the first
        conformance test is collected (the default specs then come from the conftest hook)."""
        if self.registry is not None:
            return self
        from inferhal.core.registry import BackendRegistry

        if not self.specs:
            raw = self.config.hook.pytest_inferhal_default_backends(config=self.config) or ["reference"]
            self.specs = [BackendSpec.parse(s, False) for s in raw]
        self.registry = BackendRegistry.discover()
        self.select_all()
        return self

    def select_all(self) -> None:
        from inferhal.core.config.schema import BackendConfig
        from inferhal.core.registry import BackendSelectionError

        for spec in self.specs:
            try:
                self.active[spec.id] = self.registry.select(
                    BackendConfig(name=spec.name, interpret=spec.interpret, strict=spec.strict))
            except (BackendSelectionError, RuntimeError) as exc:  # RuntimeError: e.g. a process-mode clash
                if spec.explicit:
                    raise pytest.UsageError(f"--inferhal-backend={spec.name}: {exc}") from None
                self.errors[spec.id] = str(exc).splitlines()[0]
        self.reference = self.registry.select(BackendConfig(name="reference"))


_KEY = pytest.StashKey[KitState]()


def pytest_configure(config):
    config.addinivalue_line("markers", "inferhal_conformance: a backend conformance case (inferhal kit)")
    state = KitState(config)
    config.stash[_KEY] = state
    if state.specs:  # named on the command line: select now, before any test module imports anything
        state.ensure_selected()
    if state.specs and config.args_source == pytest.Config.ArgsSource.INVOCATION_DIR:
        from inferhal.core.qualify import conformance

        config.args.append(conformance.__file__)


def pytest_report_header(config):
    state = config.stash.get(_KEY, None)
    if state is None or state.registry is None:
        return None
    from inferhal.core.qualify.runner import DEFAULT_RERUNS

    reruns = state.reruns if state.reruns is not None else f"{DEFAULT_RERUNS} (1 in an interpreter)"
    lines = [f"inferhal kit: level={state.level} reruns={reruns}"]
    for spec in state.specs:
        a = state.active.get(spec.id)
        if a is None:
            lines.append(f"  {spec.id}: not selected ({state.errors.get(spec.id)})")
        else:
            claimed = [op for op, lvl in a.ops.provenance().items() if lvl not in ("fallback", "absent")]
            lines.append(f"  {spec.id}: {a.profile.device_name}, {len(claimed)} native ops at "
                         f"{sorted(set(a.ops.provenance()[op] for op in claimed)) or ['-']}")
    return lines


def pytest_generate_tests(metafunc):
    state = metafunc.config.stash.get(_KEY, None)
    if state is None or not ({"inferhal_case", "inferhal_backend"} & set(metafunc.fixturenames)):
        return
    state.ensure_selected()
    if "inferhal_case" in metafunc.fixturenames:
        from inferhal.core.qualify.cases import op_cases
        from inferhal.core.qualify.runner import claimed_ops

        params = []
        for spec in state.specs:
            a = state.active.get(spec.id)
            if a is None:
                params.append(pytest.param(spec.id, None, id=f"{spec.id}-unavailable",
                                           marks=pytest.mark.skip(reason=state.errors.get(spec.id, ""))))
                continue
            for op in claimed_ops(a):
                for case in op_cases(op, state.level):
                    params.append(pytest.param(spec.id, case, id=f"{spec.id}-{case.key}",
                                               marks=pytest.mark.inferhal_conformance))
        metafunc.parametrize(("_inferhal_spec", "inferhal_case"), params)
    elif "inferhal_backend" in metafunc.fixturenames:
        metafunc.parametrize("_inferhal_spec", [pytest.param(s.id, id=s.id) for s in state.specs])


@pytest.fixture
def inferhal_backend(request, _inferhal_spec):
    state = request.config.stash[_KEY]
    active = state.active.get(_inferhal_spec)
    if active is None:
        pytest.skip(f"backend {_inferhal_spec} is not available here: {state.errors.get(_inferhal_spec)}")
    return active


@pytest.fixture
def inferhal_reference(request):
    return request.config.stash[_KEY].ensure_selected().reference


@pytest.fixture
def inferhal_kit(request):
    """The kit's session state (level, reruns, registry)."""
    return request.config.stash[_KEY].ensure_selected()
