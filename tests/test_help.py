"""``--help`` on every entry point (``ccexp``, ``ccexp.plan``, ``ccexp.plan model``, ``ccexp.report``,
``ccexp.ui``, ``ccexp.deliver``), alone and after other arguments, lists that entry point's own settings, exits 0 and shows
no traceback or parser error; a setting that takes a list accepts one name (``data.label_fields=domain``)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from warm import python_m
from conftest import ROOT

# (arguments, what the page must list: the entry point's own settings)
CALLS = [
    (["ccexp", "--help"], ["sampler.clip_threshold=", "train.steps=", "== Config groups"]),
    (["ccexp", "sampler=random", "train.steps=7", "--help"], ["train.steps=7", "sampler.seed="]),
    (["ccexp", "-m", "sampler=random,uniform", "--help"], ["a sweep list's first value", "sampler.name=random"]),
    (["ccexp.plan", "--help"], ["plan.source=corpus", "plan.clusters=", "sampler.name=clusterclip", "train.steps="]),
    (["ccexp.plan", "sampler=uniform", "plan.source=synthetic", "--help"],
     ["plan.source=synthetic", "sampler.name=uniform"]),
    (["ccexp.plan", "-h", "sampler.clip_threshold=2,3"], ["sampler.clip_threshold=2", "a sweep list's first value"]),
    (["ccexp.plan", "model", "--help"], ["--gpu-gb", "model.name=tiny_gpt", "trainer."]),
    (["ccexp.plan", "model", "+recipe=smollm2_135m", "--gpu-gb", "40", "--help"], ["--gpu-gb", "model.name=smollm2"]),
    (["ccexp.report", "--help"], ["--store", "--baseline", "--min-effect", "--power"]),
    (["ccexp.report", "--all-runs", "--help"], ["--parent", "--experiment"]),
    (["ccexp.ui", "--help"], ["--port", "--store"]),
    (["ccexp.ui", "--port", "5009", "--help"], ["--port"]),
    (["ccexp.deliver", "--help"], ["store", "--tracking-uri"]),
    (["ccexp.deliver", "outputs/runs/x", "--help"], ["--tracking-uri"]),
]


def call(args: list[str]) -> subprocess.CompletedProcess:
    return python_m(*args, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("args,listed", CALLS, ids=[" ".join(a) for a, _ in CALLS])
def test_help_alone_and_after_overrides_lists_the_entry_points_own_settings(args, listed):
    done = call(args)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-2000:]
    for bad in ("Traceback", "Exception", "error:", "[`"):  # no crash, no parser error, no raw cross-reference
        assert bad not in text, (bad, text[-2000:])
    missing = [item for item in listed if item not in done.stdout]
    assert missing == [], done.stdout[-3000:]


def test_help_after_an_override_that_does_not_compose_is_one_line():
    done = call(["ccexp.plan", "sampler=nonesuch", "--help"])
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("ccexp: error: ") and "nonesuch" in done.stderr


@pytest.mark.parametrize("override", ["data.label_fields=domain", "data.label_fields=[domain]"])
def test_a_list_setting_takes_one_name_as_a_one_item_list(override):
    from ccexp.config import compose

    assert list(compose(["data=jsonl", override]).data.label_fields) == ["domain"]


def test_every_list_setting_of_the_schemas_takes_one_name():
    """LIST_SETTINGS names every field typed list[...] in ccexp/config.py (a new one is found here)."""
    import dataclasses
    import typing

    from ccexp import config

    typed = {f.name for cls in vars(config).values() if dataclasses.is_dataclass(cls) and isinstance(cls, type)
             for f in dataclasses.fields(cls) if typing.get_origin(typing.get_type_hints(cls).get(f.name)) is list}
    assert typed == {key.rsplit(".", 1)[1] for key in config.LIST_SETTINGS}
    assert config.one_item_lists(["data.label_fields=domain,source", "clusterer.levels=64", "eval.lm_eval.tasks=[a]",
                                  "+data.label_fields=x", "seed=1,2"]) == [
        "data.label_fields=[domain],[source]", "clusterer.levels=[64]", "eval.lm_eval.tasks=[a]",
        "+data.label_fields=[x]", "seed=1,2"]
