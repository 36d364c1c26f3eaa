"""The docs show what exists: every recorded result in docs/perf is reported by a doc and stamped in
docs/perf/README.md's index (commit, date, host), every relative link in README.md and docs/ resolves, the
README links every doc, and the docs/ paths that code and configs name exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PERF = DOCS / "perf"
INDEX = PERF / "README.md"

LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
HASH = re.compile(r"\b[0-9a-f]{7,40}\b")


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _targets(doc: Path, text: str | None = None) -> list[tuple[str, Path]]:
    """``(link as written, resolved path)`` of each relative link in ``doc`` (URLs and bare anchors left out)."""
    out = []
    for m in LINK.finditer(doc.read_text() if text is None else text):
        target = m.group(1).split("#", 1)[0]
        if target and "://" not in target and not target.startswith("mailto:"):
            out.append((m.group(1), (doc.parent / target).resolve()))
    return out


def _results() -> list[Path]:
    return sorted(p for p in PERF.iterdir() if p.is_file() and p.name != INDEX.name)


def _index_rows() -> dict[Path, list[str]]:
    """Each file the index's table names in its first column -> that row's cells."""
    rows: dict[Path, list[str]] = {}
    for line in INDEX.read_text().splitlines():
        if not line.startswith("| ["):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        for _, path in _targets(INDEX, cells[0]):
            rows[path] = cells
    return rows


def _stamp(path: Path) -> dict | None:
    """The result's own stamp (core/bench/stamp.py) as ``{commit, date, host, command}``, or None. A stamp
    written as text ("commit abc1234, host (cpu, N CPUs), 2026-12-05") gives what it says."""
    if path.suffix != ".json":
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    s = data.get("stamp") if isinstance(data, dict) else None
    if isinstance(s, dict):
        host = s.get("host") or {}
        cpu = f"{host.get('cpu', '?')}, {host.get('logical_cpus', '?')} CPUs" if isinstance(host, dict) else str(host)
        return {"commit": str(s.get("commit", "")), "date": str(s.get("date", ""))[:10], "host": cpu,
                "command": str(s.get("command", ""))}
    if isinstance(s, str):
        commit = re.search(r"commit ([0-9a-f]{7,40})", s)
        date = re.search(r"\d{4}-\d{2}-\d{2}", s)
        return {"commit": commit.group(1) if commit else "", "date": date.group(0) if date else "", "host": s,
                "command": ""}
    return None


def _line_for(path: Path) -> str:
    """The index line to add for ``path``, filled from its stamp where it has one."""
    s = _stamp(path) or {}
    name = path.name
    command = s.get("command") or f"inferhal bench <kind> ... output=docs/perf/{name}"
    return (f"| [{name}]({name}) | <benchmark, model, backend> | `{command}` | "
            f"{s.get('commit') or '<commit: its stamp, else git log -1 --format=%h -- docs/perf/' + name + '>'} | "
            f"{s.get('date') or '<date, UTC>'} | {s.get('host') or '<host, or: not recorded>'} |")


def test_every_result_in_docs_perf_is_reported_by_a_doc():
    linked = {path for doc in _docs() if doc != INDEX for _, path in _targets(doc)}
    missing = [p for p in _results() if p.resolve() not in linked]
    assert not missing, "\n".join(
        f"docs/perf/{p.name} is linked from no doc: report it in its benchmark's section of docs/performance.md "
        f"({'![plot]' if p.suffix == '.png' else '[JSON]'}(perf/{p.name})) and remove the result it supersedes"
        for p in missing)


def test_every_result_in_docs_perf_has_a_stamped_line_in_the_index():
    rows = _index_rows()
    missing = [p for p in _results() if p.resolve() not in rows]
    assert not missing, "add a line to docs/perf/README.md's table for each (a plot can share its JSON's line:\n" \
        "[x.json](x.json), [.png](x.png)):\n" + "\n".join(_line_for(p) for p in missing)
    for path, cells in rows.items():
        assert len(cells) == 6, f"docs/perf/README.md: the line of {path.name} needs 6 cells " \
                                f"(files | benchmark | command | commit | date (UTC) | host), has {len(cells)}"
        _, _, command, commit, date, host = cells
        run = re.sub(r"^`(?:[A-Z_]+=\S+ )*", "`", command)  # environment settings first (OMP_NUM_THREADS=1 ...)
        assert run.startswith(("`inferhal ", "`python -m inferhal.")), \
            f"{path.name}: the command cell is the `inferhal ...` (or `python -m inferhal....`) that makes it"
        assert HASH.match(commit), f"{path.name}: the commit cell starts with the commit, got {commit!r}"
        assert re.match(r"\d{4}-\d{2}-\d{2}", date), f"{path.name}: the date cell starts with YYYY-MM-DD, got {date!r}"
        assert host, f"{path.name}: the host cell is empty (write 'not recorded' where nothing says)"


def test_the_index_agrees_with_each_results_own_stamp():
    for path, cells in _index_rows().items():
        s = _stamp(path)
        if not s or not s["commit"]:
            continue
        commit, date = HASH.match(cells[3]), cells[4]
        assert commit and s["commit"].startswith(commit.group(0)), \
            f"docs/perf/README.md: {path.name} was made at {s['commit']} (its stamp), the index says {cells[3]!r}"
        assert not s["date"] or date.startswith(s["date"]), \
            f"docs/perf/README.md: {path.name} is dated {s['date']} by its stamp, the index says {date!r}"


def test_every_relative_link_in_the_docs_resolves():
    broken = [f"{doc.relative_to(ROOT)}: ({written})" for doc in _docs() for written, path in _targets(doc)
              if not path.exists()]
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_the_readme_links_every_doc():
    linked = {path for _, path in _targets(ROOT / "README.md")}
    docs = [*sorted(DOCS.glob("*.md")), *sorted(DOCS.glob("*/README.md"))]
    missing = [str(d.relative_to(ROOT)) for d in docs if d.resolve() not in linked]
    assert not missing, f"README.md's Documentation list does not link {missing}"


def test_the_docs_paths_code_and_configs_name_exist():
    named = re.compile(r"docs/(?:perf|hardware)/[A-Za-z0-9_.\-]+")
    gone = []
    for top in ("core", "conf", "backends", "kernels", ".ci"):
        for path in sorted((ROOT / top).rglob("*")):
            if not path.is_file() or path.suffix in (".pyc", ".so", ".png") or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            for m in named.finditer(text):
                name = m.group(0).rstrip(".")
                if not (ROOT / name).exists():
                    gone.append(f"{path.relative_to(ROOT)}: {name}")
    assert not gone, "paths under docs/ that do not exist:\n" + "\n".join(gone)
