"""The comparison report says only what its runs support: no interval from one seed, every label value
listed, identical streams named, cost kept apart from quality, paired differences by seed."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from ccexp.tracking.report import Comparison


def run(sampler: str, seed: int, metrics: dict, digest: str = ""):
    return SimpleNamespace(data=SimpleNamespace(metrics={"train/tokens": 4096.0, **metrics}, params={"seed": str(seed)},
                                                tags={"sampler": sampler, "stream_digest": digest}))


def comparison(runs):
    return Comparison.of(runs, title="t", group_by="sampler", baseline="random", require_baseline=False)


def test_one_seed_gets_no_interval_and_says_so():
    c = comparison([run("random", 0, {"eval/ppl": 10.0}), run("uniform", 0, {"eval/ppl": 9.0})])
    md = c.markdown()
    assert c.cell("eval/ppl", "uniform") == "9 (1 seed)" and "±" not in md.split("## Every metric")[1].split("## Paired")[0]
    assert "**unresolved** -10.0% (-1, 1 pair: no interval)" in md and "n/a (needs 2 seeds)" in md  # no CI from one pair
    assert math.isnan(c.paired["eval/ppl"]["uniform"]["half"]) and not c.paired["eval/ppl"]["uniform"]["significant"]
    assert "nan" not in md.lower()  # no noise from one seed: said, not printed as nan


def test_report_html_claims_no_interval_for_one_seed_and_leads_with_the_verdict():
    import re

    one = comparison([run("random", 0, {"eval/ppl": 10.0}), run("uniform", 0, {"eval/ppl": 9.0})]).html()
    text = re.sub(r"<[^>]+>", "", one)
    table = text.split("Every metric")[1].split("Paired")[0]
    assert "means only, no confidence interval" in table and "±" not in table and "9 (1 seed)" in table
    assert text.index("unresolved") < text.index("Every metric")  # the verdict comes first
    two = comparison([run(s, k, {"eval/ppl": 10.0 + k + (s == "uniform") * 0.5}) for s in ("random", "uniform")
                      for k in range(2)]).html()
    assert "10.5 ± 6.4 (n=2)" in re.sub(r"<[^>]+>", "", two)  # with two seeds, the interval


def test_paired_differences_pair_runs_by_seed():
    runs = [run("random", s, {"eval/ppl": 10.0 + s}) for s in range(3)]
    runs += [run("uniform", s, {"eval/ppl": 9.0 + s + 0.01 * s}) for s in range(3)]
    d = comparison(runs).paired["eval/ppl"]["uniform"]
    assert d["n"] == 3 and d["mean"] == pytest.approx(-0.99) and d["significant"]  # a steady -1 across seeds


def test_a_label_value_without_held_out_documents_is_listed_not_dropped():
    m = {"eval/ppl_domain/a": 5.0, "eval/heldout_docs_domain/a": 3.0, "eval/heldout_docs_domain/b": 0.0}
    c = comparison([run("random", 0, m), run("uniform", 0, m)])
    assert "eval/ppl_domain/b" in c.metrics and c.cell("eval/ppl_domain/b", "random") == "no held-out documents"


def test_identical_streams_are_named_and_cost_is_kept_apart():
    runs = [run("uniform", 0, {"eval/ppl": 9.0, "train/tokens_per_s": 100.0}, "abc"),
            run("clusterclip", 0, {"eval/ppl": 9.0, "train/tokens_per_s": 90.0}, "abc"),
            run("random", 0, {"eval/ppl": 10.0, "train/tokens_per_s": 95.0}, "def")]
    c = comparison(runs)
    assert c.notes == ["clusterclip, uniform trained on the identical token stream (seed 0): the sampling policies "
                       "made no difference there"]
    assert "train/tokens_per_s" not in c.metrics and c.cost == ["train/tokens_per_s"]
    md = c.markdown()
    assert md.index("## Cost") > md.index("| eval/ppl |") and "train/tokens_per_s" not in c.paired
