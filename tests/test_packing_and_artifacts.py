"""The stage store publishes atomically; metric names are made MLflow-safe (packing: test_token_stream.py)."""
from __future__ import annotations

import numpy as np
import pytest

from ccexp.artifacts import DONE, StageStore, fingerprint


def test_fingerprint_depends_on_config_inputs_and_version_not_key_order():
    a = fingerprint("embed", 1, {"x": 1, "y": 2}, {"corpus": "abc"})
    assert a == fingerprint("embed", 1, {"y": 2, "x": 1}, {"corpus": "abc"})
    assert a != fingerprint("embed", 2, {"x": 1, "y": 2}, {"corpus": "abc"})
    assert a != fingerprint("embed", 1, {"x": 1, "y": 3}, {"corpus": "abc"})
    assert a != fingerprint("embed", 1, {"x": 1, "y": 2}, {"corpus": "abd"})


def test_interrupted_stage_leaves_nothing_that_looks_done(tmp_path):
    store = StageStore(tmp_path)
    with pytest.raises(RuntimeError):
        with store.publish("embed", "fp1") as tmp:
            (tmp / "embeddings.npy").write_bytes(b"partial")
            raise RuntimeError("killed")
    assert not store.is_done("embed", "fp1")
    assert list((tmp_path / "embed").iterdir()) == []
    with store.publish("embed", "fp1") as tmp:
        (tmp / "embeddings.npy").write_bytes(b"whole")
    assert store.is_done("embed", "fp1") and (store.path("embed", "fp1") / DONE).is_file()
    assert (store.path("embed", "fp1") / "embeddings.npy").read_bytes() == b"whole"


def test_folders_of_killed_writers_are_removed_on_the_next_publish(tmp_path):
    store = StageStore(tmp_path)
    orphan = tmp_path / "embed" / ".tmp-fp1-999999999-deadbeef"
    orphan.mkdir(parents=True)
    (orphan / "embeddings.npy").write_bytes(b"partial")
    with store.publish("embed", "fp2") as tmp:
        (tmp / "x").write_text("1")
    assert not orphan.exists() and store.is_done("embed", "fp2")


def test_metric_names_are_made_mlflow_safe_without_merging_values():
    from ccexp.names import metric_keys

    out = metric_keys({"eval/ppl_domain/C++": 1.0, "eval/ppl_domain/C#": 2.0, "eval/ppl_domain/": 3.0,
                       "eval/ppl_domain/code.go": 4.0})
    assert len(out) == 4 and out["eval/ppl_domain/code.go"] == 4.0
    import re as _re
    assert all(_re.fullmatch(r"[A-Za-z0-9_./ -]+", k) and not k.endswith("/") for k in out)
