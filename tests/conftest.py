"""Shared test setup. Tests never put the repository root on sys.path (see pyproject: --import-mode=importlib)."""


def _kit_plugin() -> list[str]:
    """The backend conformance kit (``--inferhal-backend``), unless the installed package already registers it
    as a pytest11 entry point (registering it twice would be an error)."""
    import importlib.metadata as md

    mod = "inferhal.core.qualify.pytest_plugin"
    return [] if any(ep.value == mod for ep in md.entry_points(group="pytest11")) else [mod]


pytest_plugins = _kit_plugin()
