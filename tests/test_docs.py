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


def doc_commands() -> list[tuple[str, str, list[str]]]:
    """(page, entry point, arguments) of every ``python -m ccexp`` / ``ccexp.plan`` command in the README's
    and the docs' code blocks, also under ``torchrun [options]`` or ``srun`` (continuation lines joined,
    comments dropped, ``$C`` as the tour defines it, and a variable the block assigns, ``B="..."``, as assigned)."""
    import shlex

    tour = "data=jsonl data.path=/data/my_corpus.jsonl.gz data.label_fields=[domain]"
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = re.sub(r"\\\n\s*", " ", page.read_text())
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            assigned = {"C": tour}
            for line in block.splitlines():
                if a := re.match(r'([A-Z][A-Z0-9_]*)="(.*)"$', line.strip()):
                    assigned[a[1]] = a[2]
                    continue
                line = re.sub(r"\$([A-Z][A-Z0-9_]*)", lambda v: assigned.get(v[1], v[0]), line)
                m = re.match(r"(?:srun\s+)?(?:(?:\.venv/bin/)?python|torchrun(?:\s+--\S+)*)\s+-m (ccexp(?:\.plan)?)\s(.*)",
                             line.strip())
                if m:
                    line = re.sub(r"<[a-z ]+>", "X", m.group(2).split(" #")[0])  # a placeholder: <date>, <run id>
                    args = shlex.split(line.replace("...", ""))
                    found.append((page.name, m.group(1), args))
    return found


def test_every_ccexp_command_in_the_docs_composes_and_passes_the_key_checks():
    """Each documented command's overrides compose (every group option and key exists) and pass the
    schemas' key and bound checks: a renamed setting or option cannot live on in the docs."""
    from ccexp import config, preflight
    from ccexp.plan import expand_sweep

    commands = doc_commands()
    assert len(commands) >= 25
    bad = []
    for page, entry, args in commands:
        overrides = []
        skip_next = False
        for a in args:
            if skip_next:
                skip_next = False
            elif a in ("--gpu-gb", "--cfg"):
                skip_next = True
            elif a.startswith("-") or a == "model" and entry == "ccexp.plan" or a.split("=")[0].startswith("hydra"):
                continue
            else:
                overrides.append(a)
        try:
            cfg = config.compose(expand_sweep(overrides)[0])  # each sweep at its first value, as Hydra reads it
            preflight._check_keys_and_bounds(cfg, config.RootConfig, "")
        except Exception as e:  # noqa: BLE001 (collected, then reported together)
            bad.append(f"{page}: {entry} {' '.join(args)} -> {type(e).__name__}: {str(e)[:200]}")
    assert bad == []


def test_the_product_stands_on_its_own_no_page_or_module_cites_the_teams_internal_docs():
    """The team's design notes (DESIGN.md, SAMPLING.md, ...) are not part of the project: the README, the docs
    site and the package (docstrings render on the API pages, configs are read by users) cite the papers and
    the project's own pages instead."""
    internal = re.compile(r"\b(DESIGN|SAMPLING|ALGORITHMS|ECOSYSTEM|STYLE|MODELS|ENVIRONMENT)\.md\b|shared/docs")
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "ccexp").rglob("*.py"),
             *(ROOT / "ccexp" / "conf").rglob("*.yaml"), *(ROOT / "benches").rglob("*.py")]
    cited = [f"{f.relative_to(ROOT)}:{n}" for f in files for n, line in enumerate(f.read_text().splitlines(), 1)
             if internal.search(line)]
    assert cited == []
