"""Every config option composes; recipes compose; bad options and keys fail with one clear line."""
from __future__ import annotations

import re

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from ccexp.__main__ import CONFIG_DIR
from ccexp.build import check_buildable
from ccexp.errors import CcexpError
from conftest import ROOT, run_ccexp

GROUP_OPTIONS = {g: sorted(p.stem for p in (CONFIG_DIR / g).glob("*.yaml"))
                 for g in ("data", "embedder", "clusterer", "sampler", "model", "trainer", "logger", "eval")}


def compose_cfg(overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        return compose("config", overrides=overrides)


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUP_OPTIONS.items() for o in opts])
def test_every_option_composes(group, option):
    cfg = compose_cfg([f"{group}={option}"])
    assert cfg[group].name == option or group == "model" and cfg[group].name


@pytest.mark.parametrize("group", ["embedder", "clusterer", "sampler"])
def test_every_buildable_option_matches_its_target(group):
    for option in GROUP_OPTIONS[group]:
        cfg = compose_cfg([f"{group}={option}"])
        if cfg[group].get("_target_"):
            check_buildable(cfg[group], group)


def test_llama2_recipe_composes_with_a_sampler_override():
    cfg = compose_cfg(["+recipe=llama2_7b", "sampler=clusterclip"])
    assert cfg.model.pretrained == "meta-llama/Llama-2-7b-hf" and cfg.model.dtype == "bfloat16"
    assert cfg.trainer.strategy == "fsdp" and cfg.trainer.devices == 8 and cfg.trainer.precision == "bf16-true"
    # 4M tokens per step = 1,024 rows of 4,096 = 8 GPUs x 64 micro-batches x 2 rows
    assert cfg.train.tokens_per_step == 4194304 and cfg.train.grad_accumulation == 64
    assert cfg.train.max_doc_tokens is None and cfg.model.gradient_checkpointing
    assert cfg.sampler.name == "clusterclip"
    assert compose_cfg(["+recipe=llama2_7b", "sampler=uniform"]).sampler.name == "uniform"


def test_unknown_key_in_a_group_is_rejected_by_the_schema():
    with pytest.raises(Exception, match="clip_treshold"):
        compose_cfg(["sampler.clip_treshold=3"])


def test_added_key_the_target_does_not_take_fails_before_work():
    cfg = compose_cfg(["+sampler.foo=1"])
    with pytest.raises(CcexpError, match=r"sampler.foo is not an option of ccexp.sampling.ClusterClipSampler"):
        check_buildable(cfg.sampler, "sampler")


def one_error_line(proc):
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ccexp: error: ")
    return lines[0]


def test_cli_wrong_option(tmp_path):
    line = one_error_line(run_ccexp("sampler=nope", f"paths.outputs={tmp_path}", cwd=ROOT))
    assert "Could not find 'sampler/nope'" in line and "cluster_dp, clusterclip, clusterclip_m2, dynamic, random, uniform" in line


def test_cli_unknown_key(tmp_path):
    line = one_error_line(run_ccexp("trian.steps=3", f"paths.outputs={tmp_path}", cwd=ROOT))
    assert "'trian.steps'" in line


def test_cli_missing_corpus_path(tmp_path):
    line = one_error_line(run_ccexp("data=jsonl", f"data.path={tmp_path}/nope.jsonl", f"paths.outputs={tmp_path}",
                                    cwd=ROOT))
    assert "nope.jsonl' does not exist" in line
    assert not (tmp_path / "cache" / "corpus").exists() or not any((tmp_path / "cache" / "corpus").iterdir())


def test_cli_required_value(tmp_path):
    line = one_error_line(run_ccexp("data=jsonl", f"paths.outputs={tmp_path}", cwd=ROOT))
    assert "data.path is required" in line


BAD_SETTINGS = [
    (["seed=-1"], "seed=-1 is out of range"),
    (["train.steps=0"], "train.steps=0 is out of range"),
    (["train.lr=-1"], "train.lr=-1.0 must be > 0"),
    (["train.seq_len=0"], "train.seq_len=0"),
    (["eval.batch_size=0"], "eval.batch_size=0"),
    (["eval.max_tokens=0"], "eval.max_tokens=0"),
    (["data.max_documents=-1"], "data.max_documents=-1"),
    (["embedder.batch_size=0"], "embedder.batch_size=0"),
    (["clusterer.k=0"], "clusterer.k=0"),
    (["trainer.precision=bogus"], "trainer.precision='bogus' is not an option"),
    (["trainer.devices=0"], "trainer.devices=0 is not valid"),
    (["+trian.steps=3"], "trian is not a ccexp setting"),
    (["+train.foo=3"], "train.foo is not a setting of train"),
    (["model.n_head=3"], "divisible by model.n_head=3"),
    (["model.tokenizer.kind=bogus"], "model.tokenizer.kind='bogus' is not an option"),
    (["model=hf_causal_lm", "model.pretrained=/nonexistent/model"], "is not a model folder"),
    (["model=hf_causal_lm", "model.pretrained=fake-org/fake-model-xyz"], "not in the local Hugging Face cache"),
    (["train.tokens_per_step=1000"], "train.tokens_per_step=1000 is not a whole number of rows of train.seq_len=128"),
    (["train.tokens_per_step=2048", "train.micro_batch_size=5"],
     "is 16 rows of 128 tokens, which do not split into micro-batches of train.micro_batch_size=5 rows on 1 rank(s) "
     "(5 rows per pass); use e.g. train.micro_batch_size=4"),
    (["train.tokens_per_step=1152", "train.micro_batch_size=4", "trainer.devices=2"],
     "use e.g. train.tokens_per_step=2048"),
    (["train.grad_accumulation=3"], "train.grad_accumulation=3 but it is derived"),
    (["train.micro_batch_size=0"], "train.micro_batch_size=0 is out of range"),
    (["train.max_doc_tokens=0"], "train.max_doc_tokens=0 is out of range"),
]


@pytest.mark.parametrize("overrides,message", BAD_SETTINGS)
def test_bad_settings_are_rejected_before_any_work(overrides, message):
    from ccexp.validate import check_config

    with pytest.raises(CcexpError, match=re.escape(message)):
        check_config(compose_cfg(overrides))


@pytest.mark.parametrize("overrides,message", [
    (["sampler.clip_threshold=0"], "clip_threshold must be an integer >= 1"),
    (["sampler.after_clip=bogus"], "after_clip='bogus' is not an option"),
    (["sampler=cluster_dp", "train.tokens_per_step=3840", "train.micro_batch_size=30"],
     "the step's 30 rows (train.tokens_per_step / train.seq_len) must be a multiple of the 32 non-empty clusters"),
    (["sampler=dynamic", "sampler.rule=doremi"], "needs sampler.reference_losses"),
])
def test_bad_sampler_options_are_rejected_before_any_work(overrides, message):
    from ccexp.validate import check_sampler_options

    with pytest.raises(CcexpError, match=re.escape(message)):
        check_sampler_options(compose_cfg(overrides))


def test_gradient_accumulation_is_derived_from_the_token_budget_and_shown_by_cfg_job(tmp_path):
    cfg = compose_cfg(["train.tokens_per_step=4096", "train.micro_batch_size=4", "trainer.devices=2"])
    assert cfg.train.grad_accumulation == 4  # 32 rows of 128 = 2 ranks x 4 micro-batches x 4 rows
    proc = run_ccexp("train.tokens_per_step=4096", "train.micro_batch_size=4", "trainer.devices=2",
                     f"paths.outputs={tmp_path}", "--cfg", "job", "--resolve", cwd=ROOT)
    assert proc.returncode == 0 and "grad_accumulation: 4" in proc.stdout and "tokens_per_step: 4096" in proc.stdout


def test_a_budget_that_does_not_split_over_the_ranks_stops_before_any_stage(tmp_path):
    """shared/cases c11, in tokens: 7 rows per step cannot be dealt to 2 processes."""
    line = one_error_line(run_ccexp("train.tokens_per_step=448", "train.seq_len=64", "train.micro_batch_size=1",
                                    "trainer.strategy=ddp_spawn", "trainer.devices=2", "logger=none",
                                    f"paths.outputs={tmp_path}", cwd=ROOT))
    assert "train.tokens_per_step=448 is 7 rows of 64 tokens" in line and "on 2 rank(s)" in line
    assert "use e.g. train.tokens_per_step=512" in line and not (tmp_path / "cache").exists()


def test_retired_document_batch_settings_point_to_the_token_budget(tmp_path):
    line = one_error_line(run_ccexp("train.global_batch_size=8", f"paths.outputs={tmp_path}", cwd=ROOT))
    assert "global_batch_size was retired" in line and "train.tokens_per_step" in line
    line = one_error_line(run_ccexp("trainer.accumulate_grad_batches=2", f"paths.outputs={tmp_path}", cwd=ROOT))
    assert "accumulate_grad_batches was retired: gradient accumulation is derived" in line


def test_embedder_st_requires_a_model():
    from omegaconf.errors import MissingMandatoryValue

    with pytest.raises(MissingMandatoryValue):
        _ = compose_cfg(["embedder=st"]).embedder.model


def test_cli_gpu_trainer_without_gpu_fails_first(tmp_path):
    line = one_error_line(run_ccexp("trainer=gpu", f"paths.outputs={tmp_path}", cwd=ROOT))
    assert "needs a CUDA GPU" in line and not (tmp_path / "cache").exists()
