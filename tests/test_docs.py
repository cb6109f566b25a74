"""The README is a front door (what ccexp answers, the two commands, a tour, links) whose links all
resolve, and the docs site's pages and navigation exist (the site itself is built with ``mkdocs build
--strict`` in ``.ci/run``)."""
from __future__ import annotations

import re

import yaml

from conftest import ROOT


def links(markdown: str) -> list[str]:
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", markdown) if not t.startswith(("http://", "https://", "#"))]


def test_the_readme_is_a_front_door_of_at_most_150_lines_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert "./scripts/setup.sh && .venv/bin/python -m ccexp\n" in text
    assert "./scripts/setup.sh && .venv/bin/python -m pytest\n" in text
    assert "trainer=ddp trainer.devices=4" in text  # the plain multi-GPU example


def test_every_link_in_the_readme_and_the_docs_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = [f"{page.relative_to(ROOT)} -> {target}" for page in pages for target in links(page.read_text())
              if not (page.parent / target.split("#")[0]).exists()]
    assert broken == []


def test_every_page_in_the_site_navigation_exists():
    def walk(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, dict):
            for v in node.values():
                yield from walk(v)
        elif isinstance(node, list):
            for v in node:
                yield from walk(v)

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    assert [p for p in walk(nav) if not (ROOT / "docs" / p).is_file()] == []
