"""Every measured figure the README and the docs state has one source, and the page agrees with it.

A figure is marked where it stands: ``**118<!--fig:first_run.default.wall_seconds--> s**``. The key's first
part names ``docs/measured/<part>.json`` (a benchmark's ``--write`` output), the rest a path in it; an optional
``/1e6`` (or any power of ten) scales the value, and ``~10%`` accepts a figure within 10 % (a count that moves
with every commit). The key ``tests.fast`` / ``tests.slow`` is the number of tests this session collected.
The figure must equal the source rounded to the decimals the page shows."""
from __future__ import annotations

import json
import re

import pytest

from conftest import COLLECTED, ROOT

MARK = re.compile(r"(\d[\d,]*(?:\.\d+)?)(?:\*\*)?\s*(?:[A-Za-z%]+\s*){0,2}<!--fig:([\w.]+)(/1e\d+)?(~\d+%)?-->")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def marked(text: str) -> list[tuple[str, str, str | None, str | None]]:
    """(figure as written, key, scale, tolerance) of every marked figure in ``text``."""
    return [m.groups() for m in MARK.finditer(text)]


def source(key: str, collected: dict[str, int]):
    name, *path = key.split(".")
    if name == "tests":
        return collected[path[0]]
    node = json.loads((ROOT / "docs" / "measured" / f"{name}.json").read_text())
    for part in path:
        node = node[part]
    return node


def disagreement(written: str, value: float, scale: str | None, tolerance: str | None) -> str | None:
    """Why ``written`` does not state ``value`` (None when it does)."""
    shown = float(written.replace(",", ""))
    value = value / float(scale[1:]) if scale else value
    if tolerance:
        share = float(tolerance[1:-1]) / 100
        return None if abs(shown - value) <= share * abs(value) else f"{written} is not within {tolerance} of {value:g}"
    decimals = len(written.split(".")[1]) if "." in written else 0
    return None if round(value, decimals) == shown else f"{written} != {value:.{decimals}f}"


def test_a_marked_figure_that_disagrees_with_its_source_is_found():
    assert marked("took **118<!--fig:first_run.default.wall_seconds--> s**") == [
        ("118", "first_run.default.wall_seconds", None, None)]
    assert marked("0.82 M tokens<!--fig:first_run.default.tokens/1e6-->")[0][2] == "/1e6"
    assert disagreement("118", 117.6, None, None) is None and disagreement("117", 117.6, None, None)
    assert disagreement("0.82", 819_200, "/1e6", None) is None and disagreement("0.9", 819_200, "/1e6", None)
    assert disagreement("650", 700, None, "~10%") is None and disagreement("370", 644, None, "~10%")


def test_every_marked_figure_in_the_readme_and_the_docs_agrees_with_its_single_source(request):
    collected = request.config.stash.get(COLLECTED, None)
    files = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    counted = set((collected or {}).get("files", ()))
    figures = [(page, *m) for page in PAGES for m in marked(page.read_text())]
    assert len(figures) >= 8  # the first run's, setup's and the test counts at least
    bad = []
    for page, written, key, scale, tolerance in figures:
        if key.startswith("tests.") and not files <= counted:
            continue  # a run of some test files cannot count the suite
        try:
            why = disagreement(written, float(source(key, collected or {})), scale, tolerance)
        except (KeyError, FileNotFoundError) as missing:
            why = f"no source {missing}"
        if why:
            bad.append(f"{page.relative_to(ROOT)}: {key}: {why}")
    assert bad == []



@pytest.mark.slow  # builds the whole site: about a minute
def test_the_built_site_renders_cross_references_as_links_and_shows_no_raw_role(tmp_path):
    """mkdocs build --strict (as CI runs it) into a temporary folder; no page of the built HTML shows a Sphinx
    role (``:class:`x```) or an unresolved ``[`x`][target]`` reference, and the API pages link to objects."""
    import os
    import subprocess
    import sys

    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    raw = re.compile(r":(?:class|meth|func|mod|attr|exc|data|obj):(?:`|<code>)|\[<code>[^<]*</code>\]\[[\w.]*\]")
    bad = {str(page.relative_to(site)): raw.findall(page.read_text())[:3] for page in site.rglob("*.html")
           if raw.search(page.read_text())}
    assert bad == {}
    sampling = (site / "api" / "sampling" / "index.html").read_text()
    assert 'class="autorefs autorefs-internal"' in sampling  # a cross-reference rendered as a link
