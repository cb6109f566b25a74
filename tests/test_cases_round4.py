"""Round 4 of the team's ``shared/cases`` (c19-c31; c18 is in ``tests/test_mlflow_server.py``), each the kind of
fault it stands for, asserting the right behaviour. The cases share one 300-document corpus
(``tests/cases/round4.jsonl``, the cases' ``corpus.jsonl``)."""
from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from ccexp.errors import CcexpError
from test_cases import CASES, ccexp, one_line

CORPUS = "round4.jsonl"


# -- c27: weights whose sum overflows ------------------------------------------------------------
def test_c27_weights_summing_to_inf_are_normalised_and_the_run_trains_on_them(tmp_path):
    """``sampler.weights=[1e308]*4``: the sum overflows a float; the weights are normalised by the largest first,
    so the mix is 0.25 each (never all zeros, never a traceback)."""
    proc = ccexp(tmp_path, CORPUS, "train.steps=2", "logger=none", "sampler=mixture",
                 "sampler.weights=[1e308,1e308,1e308,1e308]")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    line = re.search(r"mixture: cluster weights as token shares (.*) \((\d) of 4 clusters drawn\)", log)
    assert line and line.group(2) == "4" and line.group(1).count("0.250") == 4, log[-2000:]


def test_c27_every_weight_normalisation_survives_an_overflowing_sum():
    """The kind, everywhere weights are normalised: the mixture's, the source mixture's and data.sources'."""
    from ccexp.data.sources import source_weights
    from ccexp.sampling import MixtureSampler
    from ccexp.sampling.sources import normalise_source_weights
    from helpers import clustered_documents

    labels, sizes = clustered_documents([5, 5, 5])
    assert np.allclose(MixtureSampler(labels, sizes, weights=[1e308, 1e308, 0]).weights(), [0.5, 0.5, 0])
    assert np.allclose(MixtureSampler(labels, sizes, weights={0: 1e308, 2: 1.7e308}).weights(),
                       np.array([1, 0, 1.7]) / 2.7)
    assert np.allclose(normalise_source_weights([1e308, 1e308]), [0.5, 0.5])
    assert np.allclose(source_weights([{"path": "a", "weight": 1e308}, {"path": "b", "weight": 1e308}]), [0.5, 0.5])
    with pytest.raises(CcexpError, match="weight 0 is inf"):
        MixtureSampler(labels, sizes, weights=[float("inf"), 1, 1])


# -- c28: a weights file that is not UTF-8 ---------------------------------------------------------
def test_c28_a_weights_csv_that_is_not_utf8_is_one_line_naming_the_file_and_the_byte(tmp_path):
    proc = ccexp(tmp_path, CORPUS, "logger=none", "sampler=mixture", f"sampler.weights={CASES / 'weights-latin1.csv'}")
    line = one_line(proc, 2)
    assert "weights-latin1.csv' is not UTF-8 text (byte 0xe9 at offset 27); save it as UTF-8 CSV" in line
    assert not (tmp_path / "out" / "cache").exists()  # refused in pre-flight: no stage ran


@pytest.mark.parametrize("name,content,message", [
    ("w.csv", b"\x1f\x8b\x08\x00gzipped", "is not UTF-8 text (byte 0x8b at offset 1); save it as UTF-8 CSV"),
    ("w.csv", b"cluster,weight\n0,1\x00\n", "is '1\\x00', not a number"),
    ("w.json", b"[0.5, 0.5, \xff]", "is not UTF-8 text (byte 0xff at offset 11); save it as UTF-8 JSON"),
    ("bom.csv", "\ufeffcluster,weight\n0,1\n1,3\n2,0\n".encode(), None),  # Excel's UTF-8 CSV: read
])
def test_c28_every_weights_file_that_is_not_utf8_text_is_one_line(tmp_path, name, content, message):
    from ccexp.sampling import MixtureSampler
    from helpers import clustered_documents

    (tmp_path / name).write_bytes(content)
    labels, sizes = clustered_documents([5, 5, 5])
    if message is None:
        assert np.allclose(MixtureSampler(labels, sizes, weights=str(tmp_path / name)).weights(), [0.25, 0.75, 0])
        return
    with pytest.raises(CcexpError) as e:
        MixtureSampler(labels, sizes, weights=str(tmp_path / name))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_c28_reference_losses_and_a_run_folder_that_are_not_utf8_are_one_line(tmp_path):
    from ccexp.sampling import MixtureSampler
    from ccexp.sampling.dynamic import load_reference_losses
    from helpers import clustered_documents

    (tmp_path / "ref.json").write_bytes(b"[1.0, \xe9]")
    with pytest.raises(CcexpError, match=r"ref.json'.* is not UTF-8 text \(byte 0xe9 at offset 6\)"):
        load_reference_losses(str(tmp_path / "ref.json"), 2)
    (tmp_path / "run" / "tables").mkdir(parents=True)
    (tmp_path / "run" / "tables" / "clusters.csv").write_bytes(b"cluster,train_size,average_weight\n0,5,0.\xe9\n")
    labels, sizes = clustered_documents([5])
    with pytest.raises(CcexpError, match="clusters.csv' is not UTF-8 text"):
        MixtureSampler(labels, sizes, weights=str(tmp_path / "run"))


# -- c31: a run folder of the same clustering is not "another clustering" ----------------------------
def _run_folder(tmp_path, sizes):
    from ccexp.evaluation.balance import write_cluster_table

    k = len(sizes)
    return write_cluster_table(tmp_path / "run" / "tables" / "clusters.csv", sizes=np.asarray(sizes),
                               exposure=np.asarray(sizes), loss_sum=np.ones(k), loss_tokens=np.full(k, 10),
                               average_weights=np.full(k, 1 / k),
                               per_cluster={"documents": np.ones(k, int), "tokens": np.ones(k, int),
                                            "ppl": np.ones(k)}).parent.parent


def test_c31_only_the_real_clustering_is_compared_with_a_run_folders(tmp_path, caplog):
    """Pre-flight's stand-in (one document per cluster) is no clustering to compare with: it says nothing; the
    run's sampler over the same clusters says nothing; over other clusters it warns, as before."""
    from ccexp import config, preflight
    from ccexp.sampling import MixtureSampler
    from helpers import clustered_documents

    folder = _run_folder(tmp_path, [40, 30, 20, 10])
    caplog.set_level(logging.WARNING, logger="ccexp")
    preflight._check_components(config.compose(["sampler=mixture", f"sampler.weights={folder}", "clusterer.k=4"]))
    labels, sizes = clustered_documents([40, 30, 20, 10])
    MixtureSampler(labels, sizes, weights=str(folder), document_tokens=np.full(labels.size, 9))
    assert "other training sizes" not in caplog.text
    labels, sizes = clustered_documents([40, 30, 21, 9])
    MixtureSampler(labels, sizes, weights=str(folder), document_tokens=np.full(labels.size, 9))
    assert "2 of the 4 clusters of" in caplog.text and "another corpus or clustering" in caplog.text
