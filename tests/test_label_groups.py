"""clusterer=labels: a metadata field's values are the groups every sampler balances over."""
from __future__ import annotations

import numpy as np
import pytest

from ccexp.clustering.labels import LabelGroups
from ccexp.errors import CcexpError
from test_config_and_cli import compose_cfg


def test_groups_are_the_sorted_label_values_with_training_sizes_and_centroids():
    rng = np.random.default_rng(0)
    values = ["web", "code", "web", "books", "code", "web", "books"]
    x = rng.normal(size=(7, 4)).astype(np.float32)
    train = np.array([1, 1, 1, 1, 1, 0, 0], dtype=bool)
    lg = LabelGroups("src")
    c = lg.fit(x, train, label_values={"src": values})
    assert lg.names == ["books", "code", "web"]
    assert c.labels.tolist() == [2, 1, 2, 0, 1, 2, 0] and c.sizes.tolist() == [1, 2, 2]
    mean_web = x[[0, 2]].mean(0)  # training documents only
    np.testing.assert_allclose(c.centroids[2], mean_web / np.linalg.norm(mean_web), rtol=1e-5)
    assert ((c.similarity >= -1.0001) & (c.similarity <= 1.0001)).all()


def test_a_missing_field_or_a_single_value_is_one_line():
    x = np.zeros((3, 2), np.float32)
    with pytest.raises(CcexpError, match=r"clusterer.label_field='lang' is not a label of this corpus"):
        LabelGroups("lang").fit(x, np.ones(3, bool), label_values={"domain": ["a", "b", "c"]})
    with pytest.raises(CcexpError, match="has one value only"):
        LabelGroups("domain").fit(x, np.ones(3, bool), label_values={"domain": ["a", "a", "a"]})


def test_preflight_wants_the_field_among_the_corpus_labels():
    from ccexp.preflight import preflight

    with pytest.raises(CcexpError, match=r"clusterer.label_field='lang' is not among data.label_fields \['domain'\]"):
        preflight(compose_cfg(["clusterer=labels", "clusterer.label_field=lang"]))
    preflight(compose_cfg(["clusterer=labels", "sampler=uniform"]))  # domain is a label of the builtin corpus


def test_the_per_label_report_draws_any_value_as_literal_text(tmp_path):
    """Label values are data: mathtext dollars (an unbalanced one made matplotlib raise), pipes and
    newlines (they broke the Markdown table), very long and empty values."""
    import numpy as np

    from ccexp.evaluation.balance import write_label_report
    from ccexp.names import plot_text, safe_names

    names = ["price $a^$ x", "$x^2$", "a|b", "two\nlines", "v" * 300, ""]
    safe = safe_names(names)
    metrics = {f"ppl_domain/{safe[v]}": 100.0 + i for i, v in enumerate(names[:-1])}  # the last: no held-out docs
    paths = write_label_report(tmp_path, name="run", label="domain", names=names, train_docs=np.arange(1, 7),
                               corpus_tokens=np.arange(1, 7) * 10.0, tokens=np.arange(6, 0, -1), metrics=metrics)
    assert paths == [tmp_path / "label_domain.png"] and paths[0].stat().st_size > 10_000
    rows = [ln for ln in (tmp_path / "balance.md").read_text().split("## Per domain")[1].splitlines()
            if ln.startswith("| ")][1:]  # after the header
    assert len(rows) == 6 and all(r.count(" | ") == 4 for r in rows)  # one row each, five cells
    assert any("a\\|b" in r for r in rows) and any("two lines" in r for r in rows)
    assert rows[0].endswith("no held-out documents |")  # the largest value (the empty one) has none
    assert plot_text("price $a^$ x") == r"price \$a^\$ x" and len(plot_text("v" * 300)) == 40
