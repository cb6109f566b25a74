"""Every input that changes a cached stage's output is part of its key (c17), and nothing else is: each
setting, each upstream input and the stage's own code change its fingerprint; a batch size, a device or
a log setting does not."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ccexp import stage_keys as keys
from ccexp.config import compose

BASE = ["data=jsonl", "data.path=corpus.jsonl", "data.label_fields=[domain]", "curate.dedup.enabled=true",
        "sampler=dynamic", "sampler.rule=doremi"]
UPSTREAM = {"source": "s0", "content": "c0", "labels": "l0", "embed_model": "m0", "embed": "e0", "cluster": "k0",
            "model": "g0", "tokenizer": "t0", "weights": "w0", "split": "p0", "tokenize": "z0", "corpus": "f0"}


def fingerprints(overrides: list[str], **changed: str) -> dict[str, str]:
    """Each stage's fingerprint for the config ``BASE + overrides`` and the upstream digests ``UPSTREAM``
    (with ``changed`` replacing some of them)."""
    cfg = compose(BASE + overrides)
    up = {**UPSTREAM, **changed}
    return {
        "corpus": keys.stage_fingerprint("corpus", *keys.corpus_key(cfg.data, up["source"])),
        "embed": keys.stage_fingerprint("embed", *keys.embed_key(cfg.embedder, up["content"], up["embed_model"])),
        "cluster": keys.stage_fingerprint("cluster", *keys.cluster_key(cfg.clusterer, up["embed"], up["content"],
                                                                        up["labels"])),
        "dedup": keys.stage_fingerprint("dedup", *keys.dedup_key(cfg.curate.dedup, up["cluster"], up["labels"])),
        "model": keys.stage_fingerprint("model", {}, {"gguf": up["source"]}),
        "tokenize": keys.stage_fingerprint("tokenize", *keys.tokenize_key(cfg.model.tokenizer, up["content"], up["model"],
                                                                          up["tokenizer"])),
        "reference": keys.stage_fingerprint("reference", *keys.reference_key(
            cfg, {"corpus": up["corpus"], "cluster": up["cluster"], "tokenize": up["tokenize"]}, up["weights"],
            up["split"])),
    }


BASELINE = None


def test_the_proxy_key_holds_the_proxy_steps_and_the_reference_losses():
    """proxy_steps=10 and 12 give the same derived reference steps and warm-up (20 % and 5 % of either, rounded
    down): the proxy's own steps must still be in its key, or the 10-step proxy would be reused for 12."""
    from ccexp.config import DynamicConfig, compose
    from ccexp.training.reference import side_config

    cfg = compose(["sampler=doremi_mixture"])
    up = ({"corpus": "c", "cluster": "k", "tokenize": "t"}, "w", "s")

    def fp(steps: int, losses: str = "l") -> str:
        proxy = side_config(cfg, DynamicConfig(name="doremi", rule="doremi"), steps)
        return keys.stage_fingerprint("proxy", *keys.proxy_key(proxy, steps, *up, losses))

    assert fp(10) == fp(10) and fp(10) != fp(12) and fp(10) != fp(10, "other losses")


def baseline() -> dict[str, str]:
    global BASELINE
    BASELINE = BASELINE or fingerprints([])
    return BASELINE


SETTINGS = [  # (a setting that changes a stage's output, the stages it must re-key)
    ("data.label_fields=[group]", {"corpus"}), ("data.heldout_fraction=0.1", {"corpus"}),
    ("data.heldout_stratify=domain", {"corpus"}), ("data.heldout_min_per_value=3", {"corpus"}),
    ("data.text_field=body", {"corpus"}), ("data.id_field=null", {"corpus"}), ("data.max_documents=10", {"corpus"}),
    ("data.shard_documents=10", {"corpus"}), ("data.response_field=answer", {"corpus"}),
    ("embedder.max_seq_length=256", {"embed"}), ("embedder.long_documents=chunk_mean", {"embed"}),
    ("embedder.prompt=passage:", {"embed"}), ("embedder.pooling=cls", {"embed"}), ("embedder.model=other", {"embed"}),
    ("clusterer.k=5", {"cluster"}), ("clusterer.seed=1", {"cluster"}), ("clusterer.niter=3", {"cluster"}),
    ("clusterer.spherical=false", {"cluster"}), ("clusterer.max_points_per_centroid=9", {"cluster"}),
    ("clusterer.size_cap_epsilon=0.1", {"cluster"}),
    ("curate.dedup.threshold=0.9", {"dedup"}), ("curate.dedup.keep=easy", {"dedup"}), ("curate.dedup.seed=2", {"dedup"}),
    ("curate.dedup.examples=3", {"dedup"}),
    ("model.tokenizer.vocab_size=1000", {"tokenize", "reference"}), ("model.tokenizer.separator=x", {"tokenize", "reference"}),
    ("model.n_layer=3", {"reference"}), ("train.lr=0.01", {"reference"}), ("train.init_seed=4", {"reference"}),
    ("sampler.seed=4", {"reference"}), ("sampler.reference_steps=7", {"reference"}), ("eval.max_tokens=32", {"reference"}),
    ("trainer.precision=bf16-mixed", {"reference"}),
]


@pytest.mark.parametrize("override,stages", SETTINGS, ids=[s for s, _ in SETTINGS])
def test_a_setting_that_changes_a_stage_changes_its_fingerprint_and_only_its(override, stages):
    changed = {s for s, fp in fingerprints([override]).items() if fp != baseline()[s]}
    assert changed == stages


@pytest.mark.parametrize("override", ["embedder.batch_size=7", "embedder.device=cpu", "clusterer.verbose=true",
                                      "clusterer.assign_batch=99", "data.path=elsewhere.jsonl",
                                      "trainer.enable_progress_bar=false", "train.log_every_n_steps=3",
                                      "eval.every_n_steps=7", "logger=none", "report.min_effect=0.05", "trainer.threads=2"])
def test_a_setting_that_does_not_change_any_output_keeps_every_fingerprint(override):
    assert fingerprints([override]) == baseline()  # (a moved file is keyed by its bytes: the same source)


INPUTS = [("source", {"corpus", "model"}), ("content", {"embed", "cluster", "tokenize"}), ("labels", {"cluster", "dedup"}),
          ("embed_model", {"embed"}), ("embed", {"cluster"}), ("cluster", {"dedup", "reference"}), ("model", {"tokenize"}),
          ("tokenizer", {"tokenize"}), ("weights", {"reference"}), ("split", {"reference"}), ("tokenize", {"reference"}),
          ("corpus", {"reference"})]


@pytest.mark.parametrize("name,stages", INPUTS, ids=[n for n, _ in INPUTS])
def test_an_input_that_changes_changes_the_fingerprints_of_the_stages_that_read_it(name, stages):
    changed = {s for s, fp in fingerprints([], **{name: "other"}).items() if fp != baseline()[s]}
    assert changed == stages


def test_the_code_that_computes_a_stage_is_in_its_key_but_not_its_docstrings(tmp_path, monkeypatch):
    src = tmp_path / "stagecode_probe.py"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(keys.STAGE_CODE, "probe", ("stagecode_probe", "stagecode_probe:Stage.run"))

    def digest(text: str) -> str:
        src.write_text(text)
        keys.code_digest.cache_clear()
        import importlib

        importlib.invalidate_caches()
        return keys.code_digest("probe")

    first = digest('"""A stage."""\nclass Stage:\n    def run(self):\n        """Doubles."""\n        return 2 * 3  # six\n')
    assert digest('"""A stage, said otherwise."""\nclass Stage:\n    def run(self):\n        """Twice."""\n'
                  '        return 2 * 3  # 6\n') == first  # docstrings and comments: the same code
    assert digest('"""A stage."""\nclass Stage:\n    def run(self):\n        """Doubles."""\n        return 2 * 4\n') != first
    keys.code_digest.cache_clear()


def test_a_model_folder_is_keyed_by_its_bytes_and_hashed_once_per_change(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden": 8}))
    (folder / "weights.bin").write_bytes(b"\x00" * 1000)
    cache = tmp_path / "digests.json"
    first = keys.content_digest(folder, cache)
    assert keys.content_digest(folder, cache) == first and len(json.loads(cache.read_text())) == 2
    (folder / "weights.bin").write_bytes(b"\x01" * 1000)  # same path, new bytes
    assert keys.content_digest(folder, cache) != first
    assert keys.content_digest(Path(tmp_path / "nope"), cache).startswith("missing:")


def test_c17_a_clustering_made_without_labels_is_not_reused_once_labels_are_read(tmp_path):
    """c17: run once without data.label_fields, then with them: the clustering's report reads the labels,
    so it is computed again (the embedding, which does not read them, is reused). The held-out split is the
    plain hash split in both (``data.heldout_stratify=null``: with labels, ``auto`` would hold out a document
    of tiny.jsonl's rare domain, a new split and so a new embedding key)."""
    from conftest import run_ccexp
    from test_cases import CASES, TINY

    args = [a for a in TINY if not a.startswith("data.label_fields")] + [f"data.path={CASES / 'tiny.jsonl'}",
                                                                          f"paths.outputs={tmp_path}", "train.steps=2",
                                                                          "logger=none", "data.heldout_stratify=null"]
    first = run_ccexp(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    second = run_ccexp(*args, "data.label_fields=[domain]", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    log = second.stdout + second.stderr
    assert "embed: " in log and "cluster: " in log
    assert [ln for ln in log.splitlines() if "] - embed: " in ln and "reused=True" in ln]
    assert [ln for ln in log.splitlines() if "] - cluster: K=" in ln and "reused=False" in ln]
