"""``sampler=mixture``: a fixed, given cluster mix (DoReMi's train-on-the-learned-weights recipe), with
OLMo-core's max repetition factor. Determinism, exact resume and world-size independence are also
checked for it by the shared tests (tests/test_sampling_properties.py, tests/test_token_stream.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from ccexp.errors import CcexpError
from ccexp.evaluation.balance import write_cluster_table
from ccexp.sampling import MixtureSampler
from helpers import clustered_documents

# the chance that a correct sampler fails one example of the mix test (the per-cluster bounds share it, Bonferroni)
FALSE_FAILURE = 1e-7



def counts(sampler, blocks):
    docs = np.concatenate([sampler.next_block() for _ in range(blocks)])
    return np.bincount(sampler.labels[docs], minlength=sampler.num_clusters), docs


def binomial_p_values(observed: np.ndarray, n: int, p: np.ndarray) -> np.ndarray:
    """Exact two-sided binomial p-values (twice the smaller tail, at most 1) of each cluster's count."""
    low = stats.binom.cdf(observed, n, p)
    high = stats.binom.sf(observed - 1, n, p)
    return np.minimum(1.0, 2 * np.minimum(low, high))


@settings(max_examples=40, deadline=None)
@given(weights=st.lists(st.one_of(st.just(0.0), st.floats(0.01, 10.0)), min_size=2, max_size=7)
       .filter(lambda w: sum(w) > 0),
       sizes=st.lists(st.integers(1, 30), min_size=7, max_size=7), block=st.integers(1, 300), seed=st.integers(0, 2**31))
def test_the_cluster_mix_reproduces_the_given_weights_within_sampling_error(weights, sizes, block, seed):
    """Each draw's cluster is i.i.d. from the normalised weights, so cluster c's count over n draws is
    Binomial(n, π_c): every count must pass an exact two-sided binomial test at FALSE_FAILURE / K
    (Bonferroni over the K clusters); clusters of weight 0 are never drawn."""
    k = len(weights)
    labels, sizes = clustered_documents(sizes[:k], seed=seed % 1000)
    s = MixtureSampler(labels, sizes, block_size=block, seed=seed, weights=weights)
    pi = np.asarray(weights) / sum(weights)
    got, _ = counts(s, -(-3000 // block))
    n = int(got.sum())
    assert n == -(-3000 // block) * block
    assert np.all(got[pi == 0] == 0)
    p_values = binomial_p_values(got[pi > 0], n, pi[pi > 0])
    assert p_values.min() >= FALSE_FAILURE / k, (got / n, pi)
    assert np.allclose(s.weights(), pi)


@settings(max_examples=40, deadline=None)
@given(weights=st.lists(st.one_of(st.just(0.0), st.floats(0.01, 10.0)), min_size=2, max_size=6)
       .filter(lambda w: sum(w) > 0),
       sizes=st.lists(st.integers(1, 30), min_size=6, max_size=6),
       scales=st.lists(st.integers(1, 2000), min_size=6, max_size=6), block=st.integers(1, 200),
       seed=st.integers(0, 2**31))
def test_token_shares_hold_within_one_document_at_every_prefix(weights, sizes, scales, block, seed):
    """``weight_unit=tokens`` (the default): at every document boundary of the stream, every cluster of
    weight > 0 holds ``|x_c - w_c T| <= L`` tokens (x_c its tokens, T all tokens, L the longest document
    of a cluster with weight), whatever the clusters' document lengths (here each cluster's lengths are
    drawn around its own scale, 1 to 2,000 tokens); clusters of weight 0 get no token."""
    k = len(weights)
    labels, sizes = clustered_documents(sizes[:k], seed=seed % 1000)
    rng = np.random.default_rng(seed)
    tokens = np.maximum(1, (np.asarray(scales[:k])[labels] * rng.uniform(0.2, 1.8, labels.size)).astype(np.int64))
    s = MixtureSampler(labels, sizes, block_size=block, seed=seed, weights=weights, document_tokens=tokens)
    docs = np.concatenate([s.next_block() for _ in range(-(-600 // block))])
    w = np.asarray(weights) / sum(weights)
    per = np.zeros((docs.size, k))
    per[np.arange(docs.size), labels[docs]] = tokens[docs]
    x = per.cumsum(axis=0)  # tokens per cluster after each document
    T = x.sum(axis=1, keepdims=True)
    bound = tokens[w[labels] > 0].max()
    assert np.abs(x - w * T)[:, w > 0].max() <= bound + 1e-9
    assert np.all(x[-1, w == 0] == 0)


def test_equal_token_weights_give_long_documents_no_more_tokens_but_document_weights_do():
    """The issue's real case in small: four equal weights, one cluster of documents 20x longer. As token
    shares each cluster gets a quarter of the tokens (within one document); as draw probabilities
    (``weight_unit=documents``, ccexp before 2026-12-02) the long cluster takes most of them."""
    labels, sizes = clustered_documents([50, 50, 50, 50])
    tokens = np.where(labels == 0, 400, 20)
    share, total = {}, {}
    for unit in ("tokens", "documents"):
        s = MixtureSampler(labels, sizes, block_size=64, seed=3, weights=[1, 1, 1, 1], document_tokens=tokens,
                           weight_unit=unit)
        docs = np.concatenate([s.next_block() for _ in range(40)])
        got = np.bincount(labels[docs], weights=tokens[docs], minlength=4)
        share[unit], total[unit] = got / got.sum(), got.sum()
    assert np.abs(share["tokens"] - 0.25).max() <= 400 / total["tokens"]  # one long document
    assert share["documents"][0] > 0.8  # 400 / (400 + 3 · 20) = 0.87 expected


@settings(max_examples=20, deadline=None)
@given(weights=st.lists(st.floats(0.01, 10.0), min_size=3, max_size=3), seed=st.integers(0, 2**31),
       block=st.integers(1, 50))
def test_document_weights_keep_the_iid_draws_whatever_the_lengths(weights, seed, block):
    """``weight_unit=documents`` keeps the draw-probability behaviour: each draw's cluster is i.i.d. from
    the weights, so counts pass the exact binomial test however long each cluster's documents are."""
    labels, sizes = clustered_documents([20, 20, 20], seed=seed % 1000)
    tokens = np.array([1, 50, 900])[labels]
    s = MixtureSampler(labels, sizes, block_size=block, seed=seed, weights=weights, document_tokens=tokens,
                       weight_unit="documents")
    got, _ = counts(s, -(-3000 // block))
    pi = np.asarray(weights) / sum(weights)
    assert binomial_p_values(got, int(got.sum()), pi).min() >= FALSE_FAILURE / 3


def test_with_a_cap_the_rest_are_re_mixed_in_their_token_proportions():
    """When ``max_repetitions`` takes a cluster out, the others continue at their weights' proportions,
    measured in tokens from that moment (the bound holds again, counted from the change)."""
    labels, sizes = clustered_documents([3, 40, 40])
    tokens = np.array([30, 10, 30])[labels]
    s = MixtureSampler(labels, sizes, block_size=16, seed=2, weights=[0.5, 0.25, 0.25], document_tokens=tokens,
                       max_repetitions=2, on_exhausted="reset")
    docs = np.concatenate([s.next_block() for _ in range(3)])
    first_out = int(np.flatnonzero(labels[docs] == 0)[5]) + 1  # cluster 0's 6th draw: 2 passes of 3 documents
    after = docs[first_out:]
    assert not np.any(labels[after] == 0)
    got = np.bincount(labels[after], weights=tokens[after], minlength=3)
    assert abs(got[1] - got[2]) <= 30  # 0.25 : 0.25 within one document


def test_the_bound_detects_a_wrong_mix():
    """The test above has power: 3,000 draws from [0.5, 0.3, 0.2] fail it against a mix 5 points off."""
    labels, sizes = clustered_documents([20, 20, 20])
    got, _ = counts(MixtureSampler(labels, sizes, block_size=100, seed=0, weights=[0.5, 0.3, 0.2]), 30)
    assert binomial_p_values(got, 3000, np.array([0.5, 0.3, 0.2])).min() >= FALSE_FAILURE / 3
    assert binomial_p_values(got, 3000, np.array([0.45, 0.35, 0.2])).min() < FALSE_FAILURE / 3


def test_stream_is_a_function_of_the_seed_and_documents_are_passes():
    labels, sizes = clustered_documents([30, 10, 5])
    a = counts(MixtureSampler(labels, sizes, block_size=16, seed=4, weights=[1, 2, 3]), 20)[1]
    b = counts(MixtureSampler(labels, sizes, block_size=16, seed=4, weights=[1, 2, 3]), 20)[1]
    c = counts(MixtureSampler(labels, sizes, block_size=16, seed=5, weights=[1, 2, 3]), 20)[1]
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    reps = np.bincount(a, minlength=labels.size)
    for cl in range(3):  # within a cluster repetition counts differ by at most one
        assert np.ptp(reps[labels == cl]) <= 1


def test_resume_mid_stream_across_a_clip_reset():
    labels, sizes = clustered_documents([12, 5, 3, 0, 7])
    kw = dict(block_size=7, seed=9, weights=[3, 1, 1, 0, 2], max_repetitions=2, on_exhausted="reset")
    full = counts(MixtureSampler(labels, sizes, **kw), 20)[1]
    first = MixtureSampler(labels, sizes, **kw)
    counts(first, 8)  # 56 draws: past the first reset (2 · 27 = 54 draws)
    assert first.clip.resets == 1
    resumed = MixtureSampler(labels, sizes, **kw)
    resumed.load_state_dict(first.state_dict())
    assert np.array_equal(counts(resumed, 12)[1], full[56:])
    other = MixtureSampler(labels, sizes, **{**kw, "weights": [1, 1, 1, 0, 1]})
    with pytest.raises(CcexpError, match="other sampler.weights"):
        other.load_state_dict(first.state_dict())


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 3), block=st.integers(1, 20), seed=st.integers(0, 2**31),
       weights=st.lists(st.integers(0, 5), min_size=4, max_size=4).filter(lambda w: sum(w) > 0))
def test_no_document_is_drawn_more_than_max_repetitions_and_the_stream_ends(m, block, seed, weights):
    labels, sizes = clustered_documents([9, 4, 2, 6], seed=seed % 100)
    s = MixtureSampler(labels, sizes, block_size=block, seed=seed, weights=weights, max_repetitions=m)
    drawn = []
    with pytest.raises(CcexpError, match="sampler.max_repetitions"):
        for _ in range(1000):
            drawn.append(s.next_block())
            assert s.max_repetition() <= m
    reps = np.bincount(np.concatenate(drawn), minlength=labels.size)
    weighted = np.asarray(weights)[labels] > 0
    assert np.all(reps[weighted] == m) and np.all(reps[~weighted] == 0)  # the whole supply, nothing of weight 0
    assert all(len(b) == block for b in drawn[:-1])  # only the last block may be short


def test_reset_starts_the_repetition_counts_again():
    labels, sizes = clustered_documents([6, 2, 4])
    s = MixtureSampler(labels, sizes, block_size=5, seed=1, weights=[1, 1, 0], max_repetitions=2, on_exhausted="reset")
    docs = counts(s, 20)[1]  # 100 draws over 2 · 8 = 16 per period
    assert s.clip.resets == 6 and s.max_repetition() <= 2
    assert set(labels[docs]) == {0, 1} and s.active_clusters() <= 2 and not s.clipped()[2]


def test_the_token_budget_is_checked_against_the_weighted_clusters_supply():
    labels, sizes = clustered_documents([10, 10, 10])
    tokens = np.full(30, 5)
    kw = dict(weights=[1, 1, 0], max_repetitions=2, document_tokens=tokens)
    MixtureSampler(labels, sizes, token_budget=2 * 20 * 5, **kw)  # exactly the supply of clusters 0 and 1
    with pytest.raises(CcexpError, match=r"sampler.max_repetitions=2 allows at most 40 document draws = 200 tokens"):
        MixtureSampler(labels, sizes, token_budget=201, **kw)
    MixtureSampler(labels, sizes, token_budget=10_000, on_exhausted="reset", **kw)  # reset: no limit


def test_a_cap_that_clips_a_cluster_early_is_warned_about(caplog):
    labels, sizes = clustered_documents([2, 50])
    MixtureSampler(labels, sizes, weights=[0.5, 0.5], max_repetitions=3, token_budget=100, on_exhausted="reset")
    assert "clusters 0 need more than sampler.max_repetitions=3 passes" in caplog.text


# -- where the weights come from --------------------------------------------------------------
SIZES = np.array([10, 20, 30, 40])
EXPECT = np.array([0.1, 0.2, 0.3, 0.4])


def weights_of(source, names=None, sizes=SIZES):
    """The weights of a mixture over the training documents of a clustering of ``sizes`` (with lengths, as a
    run's sampler has them; pre-flight's stand-in has none)."""
    labels, sizes = clustered_documents(sizes)
    return MixtureSampler(labels, sizes, weights=source, cluster_names=names,
                          document_tokens=np.full(labels.size, 7)).weights()


def test_weights_from_a_list_and_mappings_by_id_or_name():
    assert np.allclose(weights_of([1, 2, 3, 4]), EXPECT)
    assert np.allclose(weights_of({3: 4, 0: 1, 1: 2, 2: 3}), EXPECT)
    assert np.allclose(weights_of({"3": 0.4, "0": 0.1, "1": 0.2, "2": 0.3}), EXPECT)  # ids as strings (JSON, CSV)
    names = ["code", "legal", "prose", "web"]  # sorted label values, as clusterer=labels numbers them
    assert np.allclose(weights_of({"web": 4, "prose": 3, "legal": 2, "code": 1}, names), EXPECT)
    assert np.allclose(weights_of({"web": 1, "code": 1}, names), [0.5, 0, 0, 0.5])  # left out: weight 0


def test_weights_from_csv_and_json_files(tmp_path):
    (tmp_path / "w.csv").write_text("cluster,weight\ncode,1\nlegal,2\nprose,3\nweb,4\n")
    assert np.allclose(weights_of(str(tmp_path / "w.csv"), ["code", "legal", "prose", "web"]), EXPECT)
    (tmp_path / "ids.csv").write_text("cluster,average_weight\n0,0.1\n1,0.2\n2,0.3\n3,0.4\n")
    assert np.allclose(weights_of(str(tmp_path / "ids.csv")), EXPECT)
    (tmp_path / "w.json").write_text(json.dumps([0.1, 0.2, 0.3, 0.4]))
    assert np.allclose(weights_of(str(tmp_path / "w.json")), EXPECT)
    (tmp_path / "m.json").write_text(json.dumps({"code": 1, "legal": 2, "prose": 3, "web": 4}))
    assert np.allclose(weights_of(str(tmp_path / "m.json"), ["code", "legal", "prose", "web"]), EXPECT)


def run_folder(path, average_weights):
    """A run folder's tables/clusters.csv, written by the same function a ccexp run uses."""
    k = SIZES.size
    write_cluster_table(path / "tables" / "clusters.csv", sizes=SIZES, exposure=SIZES * 3, loss_sum=np.ones(k),
                        loss_tokens=np.full(k, 10), average_weights=average_weights,
                        per_cluster={"documents": np.ones(k, int), "tokens": np.ones(k, int), "ppl": np.ones(k)})
    return path


def test_weights_learned_by_an_earlier_run(tmp_path):
    learned = np.array([0.1, 0.2, 0.3, 0.4])
    assert np.allclose(weights_of(str(run_folder(tmp_path / "dynamic", learned))), learned, atol=1e-6)
    (tmp_path / "random").mkdir()
    (tmp_path / "random" / "resolved_config.yaml").write_text("sampler:\n  name: random\n")
    with pytest.raises(CcexpError, match=r"that run \(sampler=random\) learned no weights"):
        weights_of(str(run_folder(tmp_path / "random", None)))


def test_weights_of_a_run_on_other_clusters_are_taken_with_a_warning(tmp_path, caplog):
    """Cluster ids only mean the same documents under the same clustering: weights from a run whose clusters
    have other training sizes are named as learned elsewhere."""
    folder = str(run_folder(tmp_path / "dynamic", np.array([0.1, 0.2, 0.3, 0.4])))
    weights_of(folder)
    assert "other training sizes" not in caplog.text
    weights_of(folder, sizes=[10, 20, 30, 41])
    assert "1 of the 4 clusters of" in caplog.text and "another corpus or clustering" in caplog.text


def test_empty_clusters_get_no_weight(caplog):
    assert np.allclose(weights_of([1, 1, 2], sizes=[5, 0, 5]), [1 / 3, 0, 2 / 3])
    assert "clusters 1 have no training documents" in caplog.text


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and "sampler.weights" in text, text
    return text


@pytest.mark.parametrize("source,names,message", [
    ([1, 2, 3], None, "has 3 weights but the clustering has 4 clusters"),
    ([1, -2, 3, 4], None, "weight 1 is -2.0; weights must be >= 0"),
    ([0, 0, 0, 0], None, "every weight is 0"),
    ([1, float("nan"), 3, 4], None, "weight 1 is nan"),
    ([1, "x", 3, 4], None, "weight 1 is 'x', not a number"),
    ({"web": 1}, None, "unknown cluster 'web'; this clustering's clusters have no names"),
    ({"webb": 1}, ["code", "legal", "prose", "web"], "unknown cluster 'webb'; the clusters are 'code'"),
    ({7: 1}, None, "cluster 7 is not a cluster id of this clustering (0..3)"),
    ({0: 1, "0": 2}, None, "cluster 0 is given twice"),
    ("no/such/file.csv", None, "no such file or folder"),
    (0.5, None, "give a list of weights"),
])
def test_bad_weights_give_one_line_naming_the_setting(source, names, message):
    with pytest.raises(CcexpError) as e:
        weights_of(source, names)
    assert message in one_line(e)


def test_bad_files_give_one_line(tmp_path):
    (tmp_path / "w.csv").write_text("name,weight\na,1\n")
    (tmp_path / "w.json").write_text("{not json")
    (tmp_path / "w.txt").write_text("1 2 3 4")
    (tmp_path / "empty").mkdir()
    for path, message in [("w.csv", "needs a 'cluster' column"), ("w.json", "not readable JSON"),
                          ("w.txt", "read .csv and .json files"), ("empty", "without tables/clusters.csv")]:
        with pytest.raises(CcexpError) as e:
            weights_of(str(tmp_path / path))
        assert message in one_line(e)
    with pytest.raises(CcexpError, match="all the weight is on clusters without training documents"):
        weights_of([1, 0, 1], sizes=[0, 4, 0])


def test_one_cluster_stand_in_checks_values_not_count():
    """Pre-flight (clusterer=labels) and the budget check before the embedding build the policy over
    one cluster: any count of valid weights is the mix [1]; bad values still fail."""
    labels, sizes = clustered_documents([12])
    assert MixtureSampler(labels, sizes, weights=[0.5, 0.3, 0.2]).weights().tolist() == [1.0]
    assert MixtureSampler(labels, sizes, weights={"web": 2}).weights().tolist() == [1.0]
    with pytest.raises(CcexpError, match="weights must be >= 0"):
        MixtureSampler(labels, sizes, weights=[0.5, -1])


def test_a_capped_mixture_table_shows_the_given_and_the_realised_mix_and_a_later_run_reuses_the_realised(tmp_path):
    """A run whose ``max_repetitions`` bound trained on another mix than it was given: its table holds both
    (``given_token_share``, and ``average_weight`` = the realised ``token_share``), and ``sampler.weights=<that
    run's folder>`` reuses what it trained on, not the weights it was given."""
    import csv

    k = SIZES.size
    given = np.array([0.4, 0.2, 0.2, 0.2])
    trained = np.array([152, 283, 283, 282])  # the cap bound cluster 0: 15.2 % of the tokens for a weight of 0.4
    table = write_cluster_table(tmp_path / "run" / "tables" / "clusters.csv", sizes=SIZES, exposure=SIZES,
                                loss_sum=np.ones(k), loss_tokens=trained, given_weights=given,
                                per_cluster={"documents": np.ones(k, int), "tokens": np.ones(k, int), "ppl": np.ones(k)})
    rows = list(csv.DictReader(open(table)))
    assert [float(r["given_token_share"]) for r in rows] == given.tolist()
    assert [float(r["average_weight"]) for r in rows] == [float(r["token_share"]) for r in rows]
    assert float(rows[0]["average_weight"]) == 0.152
    assert np.allclose(weights_of(str(tmp_path / "run")), trained / trained.sum(), atol=1e-6)


def test_a_run_folder_holds_token_shares_and_the_document_unit_converts_them(tmp_path):
    """A run folder's ``average_weight`` is a token share; ``weight_unit=documents`` divides by this run's
    mean document tokens (cluster 0's documents are 3x longer, so its draw probability is a third)."""
    folder = str(run_folder(tmp_path / "dynamic", np.array([0.25, 0.25, 0.25, 0.25])))
    labels, sizes = clustered_documents(SIZES)
    tokens = np.where(labels == 0, 30, 10)
    s = MixtureSampler(labels, sizes, weights=folder, document_tokens=tokens, weight_unit="documents")
    assert np.allclose(s.weights(), np.array([1 / 3, 1, 1, 1]) / (10 / 3))


@pytest.mark.parametrize("bad,message", [(dict(max_repetitions=0), "sampler.max_repetitions must be an integer >= 1"),
                                         (dict(weight_unit="bytes"), "sampler.weight_unit='bytes' is not an option"),
                                         (dict(on_exhausted="stop"), "sampler.on_exhausted='stop' is not an option"),
                                         (dict(weights=None), "sampler.weights is required")])
def test_bad_options(bad, message):
    labels, sizes = clustered_documents([3, 3])
    with pytest.raises(CcexpError, match=message.replace("(", r"\(")):
        MixtureSampler(labels, sizes, **{"weights": [1, 1], **bad})


# -- the config option ------------------------------------------------------------------------
def test_the_config_option_builds_the_sampler_and_preflight_requires_weights():
    from ccexp import config, preflight
    from ccexp.build import build

    cfg = config.compose(["sampler=mixture", "sampler.weights=[0.5,0.3,0.2]", "clusterer.k=3"])
    preflight._check_components(cfg)
    s = build(cfg.sampler, "sampler", labels=np.arange(3, dtype=np.int32), sizes=np.ones(3, dtype=np.int64))
    assert isinstance(s, MixtureSampler) and np.allclose(s.weights(), [0.5, 0.3, 0.2])
    with pytest.raises(CcexpError, match="sampler.weights has 3 weights but the clustering has 4"):
        preflight._check_components(config.compose(["sampler=mixture", "sampler.weights=[0.5,0.3,0.2]",
                                                    "clusterer.k=4"]))
    with pytest.raises(CcexpError, match="sampler.weights is required"):
        preflight._check_missing(config.compose(["sampler=mixture"]))
    with pytest.raises(CcexpError, match="sampler.weight_unit='bytes' is not an option; use 'tokens'"):  # docs/errors.md
        preflight._check_components(config.compose(["sampler=mixture", "sampler.weights=[1,1,1,1]",
                                                    "sampler.weight_unit=bytes"]))


@pytest.mark.slow
def test_a_run_trains_on_the_given_mixture(tmp_path):
    """``python -m ccexp sampler=mixture 'sampler.weights=[...]'`` end to end (the cases' tiny run, 25-50 s):
    a cluster of weight 0 is never trained on, and the cap holds."""
    import csv

    from conftest import ROOT, run_ccexp
    from test_cases import CASES, TINY

    proc = run_ccexp(*TINY, f"data.path={CASES / 'tiny.jsonl'}", f"paths.outputs={tmp_path}", "sampler=mixture",
                     "sampler.weights=[0.4,0.3,0.3,0]", "sampler.max_repetitions=8", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (table,) = tmp_path.glob("runs/*/*/tables/clusters.csv")
    rows = list(csv.DictReader(open(table)))
    exposure = np.array([int(r["exposure"]) for r in rows])
    sizes = np.array([int(r["train_size"]) for r in rows])
    assert exposure[3] == 0 and exposure[:3].min() > 0 and np.all(exposure <= 8 * sizes)


def _average_weights(run_folder, column="average_weight"):
    import csv

    rows = list(csv.DictReader(open(next(run_folder.glob("tables/clusters.csv")))))
    return np.array([float(r[column]) for r in rows]), np.array([int(r["train_size"]) for r in rows])


@pytest.mark.slow
def test_a_doremi_run_followed_by_a_mixture_run_on_its_weights_trains_on_them(tmp_path):
    """DoReMi's two steps by hand: ``sampler=doremi`` learns weights; ``sampler=mixture sampler.weights=<its run
    folder>`` trains on them (the mixture's table carries the weights it drew from, normalised over the clusters
    with training documents), and its exposure follows them."""
    from conftest import ROOT, run_ccexp
    from test_cases import CASES, TINY

    base = [*TINY, f"data.path={CASES / 'tiny.jsonl'}", f"paths.outputs={tmp_path}", "train.steps=30"]
    proc = run_ccexp(*base, "sampler=doremi", "sampler.reference_steps=5", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (doremi,) = [p.parent.parent for p in tmp_path.glob("runs/*/*/tables/clusters.csv")]
    learned, sizes = _average_weights(doremi)
    assert learned.std() > 0  # DoReMi moved the weights off uniform
    proc = run_ccexp(*base, "sampler=mixture", f"sampler.weights={doremi}", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (mixture,) = [p.parent.parent for p in tmp_path.glob("runs/*/*/tables/clusters.csv") if p.parent.parent != doremi]
    given, _ = _average_weights(mixture, "given_token_share")
    expected = np.where(sizes > 0, learned, 0) / np.where(sizes > 0, learned, 0).sum()
    np.testing.assert_allclose(given, expected, rtol=1e-5, atol=1e-6)
    realised, _ = _average_weights(mixture)  # the token shares it trained on: within a few documents of the given
    assert np.abs(realised - given).max() < 0.05
    assert "mixture: cluster weights as token shares" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_doremi_mixture_learns_the_weights_with_a_proxy_run_then_trains_on_them(tmp_path):
    """DoReMi's two-step recipe in one command (``sampler=doremi_mixture``): the reference and proxy runs are
    cached prior runs; the run trains on the proxy's average weights; a second run reuses both."""
    from conftest import ROOT, run_ccexp
    from test_cases import CASES, TINY

    args = [*TINY, f"data.path={CASES / 'tiny.jsonl'}", f"paths.outputs={tmp_path}", "train.steps=20",
            "sampler=doremi_mixture", "sampler.proxy_steps=12"]
    proc = run_ccexp(*args, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "proxy: training DoReMi's proxy model, 12 steps" in log
    assert "reference: training the DoReMi reference model" in log
    (proxy,) = tmp_path.glob("cache/proxy/*/weights.npy")
    learned = np.load(proxy)
    (run,) = [p.parent.parent for p in tmp_path.glob("runs/*/*/tables/clusters.csv")]
    given, sizes = _average_weights(run, "given_token_share")
    expected = np.where(sizes > 0, learned, 0) / np.where(sizes > 0, learned, 0).sum()
    np.testing.assert_allclose(given, expected, rtol=1e-5, atol=1e-6)
    again = run_ccexp(*args, "train.resume_from=fresh", cwd=ROOT)  # again (a finished run is otherwise not redone)
    assert again.returncode == 0, again.stderr[-3000:]
    import re

    log = again.stdout + again.stderr
    assert re.search(r"proxy: a 12-step DoReMi proxy learned token shares .*reused=True", log)
    assert "proxy: training" not in log


def test_a_mapping_by_label_value_reaches_the_sampler_as_the_run_builds_it():
    """Under clusterer=labels the clustering's names (the label values) reach the sampler, which declares it
    needs them, so ``sampler.weights={finance: 3, sports: 1}`` means what it says."""
    from ccexp.config import compose
    from ccexp.training.runner import sampler_over

    cfg = compose(["sampler=mixture", "sampler.weights={finance: 3, sports: 1}", "clusterer=labels"])
    labels = np.array([0, 1, 2, 0, 1, 2], dtype=np.int32)
    sampler = sampler_over(cfg.sampler, cfg.train, labels, np.array([2, 2, 2]), np.full(6, 30),
                           cluster_names=["finance", "music", "sports"])
    assert np.allclose(sampler.weights(), [0.75, 0, 0.25])
    with pytest.raises(CcexpError, match="sampler.weights"):
        sampler_over(cfg.sampler, cfg.train, labels, np.array([2, 2, 2]), np.full(6, 30))  # no names: ids only
