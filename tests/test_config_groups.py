"""The groups that add to a run without code: ``callbacks/`` and ``logger/`` (Lightning objects built from
``_target_``, :mod:`ccexp.training.extras`) and ``debug/`` (tiny, overfit, profiler). Every option composes
and each of its ``_target_`` entries is built for real; TensorBoard, W&B (offline) and the overfit run train end to end."""
from __future__ import annotations

import glob
from pathlib import Path

import pytest
from mlflow import MlflowClient
from omegaconf import OmegaConf, open_dict

from ccexp.__main__ import CONFIG_DIR
from ccexp.config import compose
from conftest import run_ccexp

CASES = Path(__file__).parent / "cases"
DATA = ["data=jsonl", "data.label_fields=[domain]", f"data.path={CASES / 'tiny.jsonl'}"]
OPTIONS = [(g, p.stem) for g in ("callbacks", "logger", "debug") for p in sorted((CONFIG_DIR / g).glob("*.yaml"))]


def targets(node, path: str = ""):
    """(key, node) of every mapping with a ``_target_`` under ``node``."""
    if OmegaConf.is_dict(node) and not node._is_none() and not node._is_missing() and not node._is_interpolation():
        if "_target_" in node:
            yield path, node
        for key in node:
            yield from targets(node._get_node(key), f"{path}.{key}" if path else str(key))


def test_the_groups_have_their_options():
    assert {g: sorted(o for gg, o in OPTIONS if gg == g) for g in ("callbacks", "logger", "debug")} == {
        "callbacks": ["device_stats", "lr_monitor", "none", "timer"], "logger": ["mlflow", "none", "tensorboard", "wandb"],
        "debug": ["overfit", "profiler", "tiny"]}


@pytest.mark.parametrize("group,option", OPTIONS)
def test_every_option_composes_and_each_target_is_built(group, option, tmp_path):
    from ccexp.build import build
    from ccexp.preflight import _check_keys_and_bounds
    from ccexp import config

    cfg = compose([f"{group}={option}", f"paths.outputs={tmp_path}"])
    _check_keys_and_bounds(cfg, config.RootConfig, "")  # pre-flight's key checks pass
    if group == "logger":
        assert cfg.logger.name == option
    with open_dict(cfg):  # the run folder Hydra gives a real run (${hydra:runtime.output_dir})
        if cfg.trainer.profiler is not None:
            cfg.trainer.profiler.dirpath = str(tmp_path / "run")
    built = {key: build(node, key) for key, node in targets(cfg) if key.startswith(("callbacks.", "logger.", "trainer."))}
    expected = {("callbacks", "none"): set(), ("callbacks", "lr_monitor"): {"LearningRateMonitor"},
                ("callbacks", "device_stats"): {"DeviceStatsMonitor"}, ("callbacks", "timer"): {"LaunchTimer"},
                ("logger", "mlflow"): set(), ("logger", "none"): set(), ("logger", "tensorboard"): {"TensorBoardLogger"},
                ("logger", "wandb"): {"WandbLogger"}, ("debug", "tiny"): set(), ("debug", "overfit"): {"RepeatFirstBatch"},
                ("debug", "profiler"): {"SimpleProfiler"}}[group, option]
    assert {type(obj).__name__ for obj in built.values()} == expected


def test_callbacks_combine_with_hydra_list_syntax_and_extras_build_them_in_name_order():
    from ccexp.training.extras import build_callbacks, build_loggers

    cfg = compose(["callbacks=[lr_monitor,device_stats]", "logger=tensorboard", "debug=overfit"])
    assert sorted(cfg.callbacks) == ["device_stats", "lr_monitor", "overfit_batch"]
    assert [type(c).__name__ for c in build_callbacks(cfg.callbacks)] == [
        "DeviceStatsMonitor", "LearningRateMonitor", "RepeatFirstBatch"]
    assert [type(x).__name__ for x in build_loggers(cfg.logger.loggers)] == ["TensorBoardLogger"]
    assert build_callbacks(compose(["callbacks=[lr_monitor]", "callbacks.lr_monitor=null"]).callbacks) == []
    assert build_callbacks(None) == [] and build_loggers(compose([]).logger.loggers) == []


def test_a_bad_target_is_one_line_naming_the_entry():
    from ccexp.errors import CcexpError
    from ccexp.training.extras import build_callbacks

    cfg = compose(["callbacks=lr_monitor", "callbacks.lr_monitor.logging_interval=hour"])
    with pytest.raises(Exception, match="logging_interval"):
        build_callbacks(cfg.callbacks)
    cfg = compose(["callbacks=lr_monitor", "+callbacks.lr_monitor.no_such=1"])
    with pytest.raises(CcexpError, match=r"callbacks\.lr_monitor: cannot build"):
        build_callbacks(cfg.callbacks)


def test_debug_tiny_holds_the_tiny_sizes_and_no_data():
    cfg = compose(["debug=tiny"])
    assert (cfg.train.steps, cfg.train.tokens_per_step, cfg.train.seq_len, cfg.train.grad_accumulation) == (20, 512, 64, 1)
    assert (cfg.clusterer.k, cfg.model.n_positions, cfg.model.tokenizer.vocab_size) == (4, 64, 512)
    assert cfg.data == compose([]).data  # the data is the run's own
    assert compose(["debug=overfit", "sampler=uniform"]).sampler.name == "uniform"  # the command line wins


@pytest.mark.slow  # a real run: about 35 s on one core
def test_tensorboard_logs_beside_the_mlflow_run_and_the_profiler_reports_into_the_run_folder(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    out = tmp_path / "out"
    proc = run_ccexp("debug=profiler", *DATA, f"paths.outputs={out}", "logger=tensorboard", "callbacks=lr_monitor",
                     "sampler=random", cwd=tmp_path)  # debug=profiler: the tiny sizes, and Lightning's profiler
    assert proc.returncode == 0, proc.stderr[-3000:]
    (report,) = out.glob("runs/*/*/fit-profile.txt")  # the profiler writes its report into the run folder
    assert "run_training_batch" in report.read_text()
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("ccexp").experiment_id])[0]
    version = out / "tensorboard" / run.info.run_name / "version_0"  # the run called as MLflow calls it
    acc = EventAccumulator(str(version))  # every events file of the run (training, then the final metrics)
    acc.Reload()
    # the HParams tab: the run's settings, and the headline held-out metrics as its columns (logged at the end)
    from tensorboard.plugins.hparams import plugin_data_pb2

    hp = {k: plugin_data_pb2.HParamsPluginData.FromString(v) for k, v in acc.PluginTagToContent("hparams").items()}
    metric_tags = {m.name.tag for m in hp["_hparams_/experiment"].experiment.metric_infos}
    assert {"eval/ppl_macro", "eval/ppl"} <= metric_tags <= set(acc.Tags()["scalars"])
    assert hp["_hparams_/session_start_info"].session_start_info.hparams["sampler.name"].string_value == "random"
    # one axis: the held-out curve at the optimizer step, with the tokens trained beside it; the layout names it
    curve_steps = [e.step for e in acc.Scalars("curve/ppl")]
    tokens = {e.step: e.value for e in acc.Scalars("curve/tokens_trained")}
    assert curve_steps and max(curve_steps) <= 20 and tokens[curve_steps[-1]] == 512 * curve_steps[-1]
    layout = layout_pb2.Layout()  # the Custom Scalars tab's layout names the axis
    layout.ParseFromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    assert [c.title for c in layout.category] == ["ccexp: held-out curve (x: optimizer step)",
                                                  "ccexp: training (x: optimizer step)"]
    loss = [e.value for e in acc.Scalars("train/loss")]
    tags = set(acc.Tags()["scalars"])
    assert {"eval/ppl", "eval/ppl_macro", "curve/ppl", "sampler/active_clusters"} <= tags, sorted(tags)[:20]
    assert len(loss) == 2 and 0 < loss[-1] < loss[0] < 7  # steps 10 and 20 (log_every_n_steps=10); ln 512 = 6.2
    assert any(t.startswith("lr-AdamW") for t in acc.Tags()["scalars"])  # the callback's metric reaches it too
    assert run.info.status == "FINISHED" and "eval/ppl" in run.data.metrics
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [round(m.value, 4) for m in sorted(history, key=lambda m: m.step)] == [round(v, 4) for v in loss]


@pytest.mark.slow  # two real runs: about 60 s on one core
def test_wandb_logs_offline_beside_mlflow_one_wandb_run_per_sweep_job(tmp_path):
    """logger=wandb: no account, no network (offline mode); each job of a sweep is its own W&B run folder
    under <outputs>/wandb/wandb/, whose transaction log (what `wandb sync` uploads, read record by record)
    holds the run's config, its training and held-out curves and its final metrics (the same values as the
    MLflow run's), and whose media hold the run's tables."""
    import json

    from helpers import wandb_records

    out = tmp_path / "out"
    env_free = {"WANDB_API_KEY": None, "WANDB_MODE": None}  # nothing of a real account may help
    proc = run_ccexp("-m", "debug=tiny", *DATA, f"paths.outputs={out}", "logger=wandb", "sampler=random,uniform",
                     cwd=tmp_path, env=env_free)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folders = sorted((out / "wandb" / "wandb").glob("offline-run-*"))
    assert len(folders) == 2, folders  # one per job: the first job's run was finished, not continued
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    runs = {r.data.tags["sampler"]: r for r in client.search_runs([client.get_experiment_by_name("ccexp").experiment_id])
            if r.data.tags.get("mlflow.parentRunId")}
    seen = set()
    for folder in folders:
        config, history = {}, {}
        for record in wandb_records(next(folder.glob("run-*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "config":
                config.update({item.key: json.loads(item.value_json) for item in record.config.update})
            elif kind == "history":
                for item in record.history.item:
                    history.setdefault(item.key or "/".join(item.nested_key), []).append(json.loads(item.value_json))
        sampler = config["sampler.name"]["value"] if isinstance(config["sampler.name"], dict) else config["sampler.name"]
        seen.add(sampler)
        metrics = runs[sampler].data.metrics
        for key in ("eval/ppl", "eval/ppl_macro", "train/loss", "sampler/active_clusters", "curve/ppl"):
            assert history[key][-1] == pytest.approx(metrics[key], rel=1e-6), key
        assert len(history["train/loss"]) == 2 and len(history["curve/ppl"]) >= 2  # curves, not one point
        (table,) = folder.glob("files/media/table/tables/clusters_*.table.json")
        csv_rows = (Path(runs[sampler].data.tags["run_dir"]) / "tables" / "clusters.csv").read_text().splitlines()
        assert len(json.loads(table.read_text())["data"]) == len(csv_rows) - 1  # every cluster's row
    assert seen == {"random", "uniform"}


@pytest.mark.slow  # a real run: about 35 s on one core
def test_debug_overfit_drives_the_loss_of_one_batch_far_down(tmp_path):
    out = tmp_path / "out"
    proc = run_ccexp("debug=overfit", *DATA, f"paths.outputs={out}", "train.steps=60", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "debug: overfitting one micro-batch of 8 rows (512 tokens)" in proc.stdout + proc.stderr
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("ccexp").experiment_id])[0]
    loss = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)]
    assert len(loss) == 60 and loss[0] > 5.0  # about ln 512 = 6.2 before it has learnt anything
    assert loss[-1] < 0.1 * loss[0]  # one batch is learnt nearly by heart (a normal run is near 3.6 at step 20)


@pytest.mark.parametrize("args,line", [
    (["debug=tyni"], "Could not find 'debug/tyni' Available options in 'debug': overfit, profiler, tiny"),
    (["callbacks=lr_monitor", "callbacks.lr_monitor.logging_interval=hourly"],
     "callbacks.lr_monitor: logging_interval should be `step` or `epoch` or `None`."),
    (["callbacks=timer", "callbacks.timer.duration=banana"], "callbacks.timer: "),
])
def test_a_bad_debug_option_or_callback_value_is_one_line_before_any_stage(args, line, tmp_path):
    proc = run_ccexp(*args, "logger=none", f"paths.outputs={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 2 and line in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "cache").exists()
