"""The qualify report opened in a real headless Chromium (Debian's ``chromium``, installed by ``.ci/bootstrap
test``): the DOM it builds has the verdict table first, one row per area with its level, and the screenshot
shows it (the top of the page holds the pass badges' green and the fail badge's red, not a blank page).
Skipped, with the reason, where Chromium is absent; under CI (CI=true) its absence is a failure."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)
GREEN, RED = (0x1A, 0x7F, 0x37), (0xCF, 0x22, 0x2E)  # the pass and fail badges (core/qualify/verdicts.py)


def chromium() -> str:
    exe = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
    if exe is None:
        why = "headless Chromium is not installed (Debian: apt-get install chromium; .ci/bootstrap test does it)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the report's browser test: {why}")
        pytest.skip(why)
    return exe


def browse(exe: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--no-first-run", "--disable-dev-shm-usage", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """A real report of the reference (one op, golden off), with the audits of a toy engine (TEST01 broken on
    purpose: a fail row) and this host's manifest, written as the CLI writes it."""
    from omegaconf import OmegaConf

    from inferhal.core.config.schema import BackendConfig
    from inferhal.core.qualify import report, runner
    from inferhal.core.qualify.manifest import manifest
    from inferhal.core.registry import BackendRegistry

    sys.path.insert(0, HERE)
    try:
        from test_audits import fake_run
    finally:
        sys.path.remove(HERE)
    out = tmp_path_factory.mktemp("report")
    reg = BackendRegistry.discover()
    ref = reg.select(BackendConfig(name="reference"))
    _, aud = fake_run({"perf": "batch"})
    extra = lambda: {"audits": aud, "manifest": manifest("reference", {}, OmegaConf.create({"x": 1}),  # noqa: E731
                                                         reg.extra("reference", "environment"))}
    rep = runner.run(ref, ref, runner.QualifyOptions(ops=("embed",), output_dir=str(out), progress=False),
                     extra_sections=extra)
    return rep, report.write(rep, out)["html"]


def test_the_verdict_table_comes_first_and_names_every_area_with_its_level(page):
    rep, html_path = page
    exe = chromium()
    dom = browse(exe, "--dump-dom", html_path.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    text = dom.stdout
    assert "<table id=\"verdicts\">" in text
    assert text.index("<table id=\"verdicts\">") == text.index("<table"), "the verdict table is not the first table"
    first = text[text.index("<table id=\"verdicts\">"):text.index("</table>")]
    for area in ("ops against the reference", "batch invariance per op", "TEST01", "TEST04", "TEST06", "determinism"):
        assert area in first, area
    assert first.count("<tr>") == 1 + 6  # header + ops, invariance, four audits
    assert "interpreter (+1 reference fallbacks)" in first and ">fail<" in first  # the toy engine's level, TEST01
    assert rep["summary"]["verdict"] == "fail" and rep["summary"]["failed_audits"] == ["TEST01"]
    assert "id=\"manifest\"" in text and "config sha256" in text and "backend toolchain: products" in text


def test_the_screenshot_shows_the_verdicts(page, tmp_path):
    from PIL import Image

    _, html_path = page
    exe = chromium()
    png = tmp_path / "report.png"
    shot = browse(exe, f"--screenshot={png}", "--window-size=1200,900", html_path.as_uri())
    assert shot.returncode == 0 and png.exists(), shot.stderr[-2000:]
    img = Image.open(png).convert("RGB")
    assert img.size == (1200, 900)
    top = img.crop((0, 0, 1200, 450))  # the title and the verdict table
    colors = top.getcolors(maxcolors=1 << 20)
    assert len(colors) > 20, "the page is blank"

    def near(c, ref):
        return all(abs(a - b) <= 12 for a, b in zip(c, ref))

    found = {name: sum(n for n, c in colors if near(c, ref)) for name, ref in (("green", GREEN), ("red", RED))}
    assert found["green"] > 50 and found["red"] > 50, found
