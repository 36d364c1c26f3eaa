"""core/'s layers, enforced: a module imports only from its own layer or below, at the top or inside a function
(a deferred import hides a dependency, it does not remove it), and no two modules import each other, directly or
round a circle. Imports under ``if TYPE_CHECKING:`` are annotations only and do not count.

The table is the design: the lowest layer names what everything may use (errors, the console, the op
vocabulary), the highest the commands. A new package gets a row; an upward import is fixed by moving the shared
part down (STYLE 14), not by adding an exception here."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORE = ROOT / "core"

#: core's packages (and top-level modules) by layer, lowest first
LAYERS: list[tuple[str, ...]] = [
    ("errors", "console", "host", "procs", "ops", "profile", "backend", "hookspecs"),
    ("eplb", "structured", "paging"),
    ("config",),
    ("sampling", "scheduler", "registry"),
    ("models", "spec"),
    ("engine",),
    ("parallel",),
    ("disagg",),
    ("server",),
    ("plan", "bench", "qualify"),
    ("cli",),
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def unit(module: str) -> str:
    """``inferhal.core.engine.runner`` → ``engine``; ``inferhal.core.errors`` → ``errors``."""
    return module.split(".")[2]


def _module(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("inferhal", *parts))


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every ``inferhal`` import in ``path`` (relative ones resolved), outside
    ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text(), str(path))
    here = _module(path)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the module pkg.sub when there is one, else a name of pkg
            targets = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base for a in node.names]
            found.extend((node.lineno, t) for t in targets if t.startswith("inferhal."))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names if a.name.startswith("inferhal."))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _files(*tops: str) -> list[pathlib.Path]:
    return sorted(p for top in (tops or ("core",)) for p in (ROOT / top).rglob("*.py"))


def test_every_core_package_has_a_layer():
    names = {p.name.removesuffix(".py") for p in CORE.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.name != "__init__.py")}
    missing = sorted(names - set(LAYER))
    assert not missing, f"give these core packages a row in LAYERS: {missing}"


def test_no_import_runs_up_the_layers():
    bad = []
    for path in _files():
        me = unit(_module(path)) if path.parent != CORE or path.name != "__init__.py" else None
        if me is None:
            continue
        for line, target in imports(path):
            if not target.startswith("inferhal.core."):
                continue  # a backend or kernel import: tests/core/test_isolation.py refuses those
            them = unit(target)
            if them != me and LAYER.get(them, -1) > LAYER[me]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {me} (layer {LAYER[me]}) imports {target} "
                           f"(layer {LAYER[them]})")
    assert not bad, f"{len(bad)} imports run up the layers:\n" + "\n".join(bad)


def test_no_import_circle_between_modules():
    """In core/, backends/ and kernels/."""
    graph: dict[str, set[str]] = {}
    for path in _files("core", "backends", "kernels"):
        graph[_module(path)] = {t for _, t in imports(path)}
    known = set(graph)

    def resolve(target: str) -> str | None:  # a name imported from a module is the module
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    edges = {m: {r for t in ts if (r := resolve(t)) and r != m} for m, ts in graph.items()}
    circles, state, stack = [], {}, []

    def walk(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                circles.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                walk(n)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            walk(m)
    assert not circles, f"{len(circles)} import circles:\n" + "\n".join(circles)
