"""lm-evaluation-harness on the trained model, in process and offline.

For any corpus ccexp writes local task YAMLs at run time, with absolute data paths (lm-eval
resolves relative ``data_files`` against the working directory, lm-eval's task loader):

* ``ccexp_ppl_<label>`` — ``loglikelihood_rolling`` perplexity (word and byte perplexity, bits per
  byte) of the held-out documents of each label value (e.g. each ``domain``), or of all held-out
  documents when the corpus has no labels;
* ``ccexp_continuation`` — ``multiple_choice``: given the first half of a held-out document, pick its
  true second half among four (the other three are second halves of other held-out documents of
  similar length). Chance is 25 %.

Standard tasks (``mmlu``, ``hellaswag``, ...) are added by name when their datasets are in the local
Hugging Face cache. The model object is wrapped in ``HFLM`` (lm-eval's Hugging Face adapter), so
nothing is saved or reloaded; under DDP/FSDP this runs on rank 0 with the full weights.
"""
from __future__ import annotations

import functools
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("ccexp")

_HEADER = """task: {task}
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""

_MC_TEMPLATE = _HEADER + """output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

_PPL_TEMPLATE = _HEADER + """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
metadata:
  version: 1.0
"""


def task_names(values: list[str]) -> dict[str, str]:
    """A distinct lm-eval task name ``ccexp_ppl_<value>`` for every label value ([`ccexp.names.safe_names`][ccexp.names.safe_names])."""
    from ccexp.names import safe_names

    return {v: f"ccexp_ppl_{name}" for v, name in safe_names(values, allowed="a-z0-9_", lower=True).items()}


def fit_to_context(context: str, choices: list[str], tokenizer, max_length: int | None) -> tuple[str, list[str]]:
    """Cut a multiple-choice question so that context + any choice fits ``max_length`` tokens: the
    choices keep their first tokens (at most half the context window), the context its last ones."""
    if tokenizer is None or not max_length:
        return context, choices
    ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in choices]
    budget = max_length - 1  # lm-eval scores context + continuation inside the window
    keep = min(max(len(i) for i in ids), budget // 2)
    if max(len(i) for i in ids) > keep:
        choices = [tokenizer.decode(i[:keep]) if len(i) > keep else c for c, i in zip(choices, ids)]
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    room = budget - keep
    return (tokenizer.decode(ctx[-room:]) if len(ctx) > room else context), choices


def write_local_tasks(out_dir: Path, texts: list[str], labels: list[str] | None, *, max_docs_per_task: int = 200,
                      mc_docs: int = 200, max_chars: int = 1500, seed: int = 0, tokenizer=None,
                      max_length: int | None = None) -> list[str]:
    """Write the task YAMLs and their JSONL data into ``out_dir``; return the task names.

    Args:
        texts: held-out documents; labels: one label value per document (or None).
        max_docs_per_task: documents per perplexity task (a seeded subsample).
        mc_docs: questions in the multiple-choice task (documents of >= 40 characters).
        max_chars: documents are cut to this many characters.
        tokenizer, max_length: the model's tokenizer and context; each multiple-choice question is cut
            to fit it ([`fit_to_context`][ccexp.evaluation.lm_eval_bridge.fit_to_context]). Perplexity tasks score rolling windows, which always fit.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    texts = [t[:max_chars] for t in texts]
    groups: dict[str, list[int]] = {}
    for i, value in enumerate(labels if labels is not None else ["all"] * len(texts)):
        groups.setdefault(value, []).append(i)
    names = task_names(list(groups))
    tasks = []
    for value, idx in sorted(groups.items()):
        task = names[value]
        pick = rng.permutation(idx)[:max_docs_per_task]
        data = out_dir / f"{task}.jsonl"
        data.write_text("".join(json.dumps({"text": texts[i]}) + "\n" for i in sorted(pick)))
        (out_dir / f"{task}.yaml").write_text(_PPL_TEMPLATE.format(task=task, data=json.dumps(str(data.resolve()))))
        tasks.append(task)
    long_docs = [i for i, t in enumerate(texts) if len(t) >= 40]
    if len(long_docs) >= 4:
        chosen = rng.permutation(long_docs)[:mc_docs]
        halves = {i: _split_half(texts[i]) for i in long_docs}
        by_length = sorted(long_docs, key=lambda i: len(halves[i][1]))
        rank = {i: r for r, i in enumerate(by_length)}
        rows = []
        for i in chosen:
            near = [j for j in by_length[max(0, rank[i] - 6):rank[i] + 7] if j != i]
            distractors = list(rng.choice(near, size=3, replace=False)) if len(near) >= 3 else \
                list(rng.choice([j for j in long_docs if j != i], size=3, replace=False))
            options = [halves[i][1]] + [halves[j][1] for j in distractors]
            order = rng.permutation(4)
            context, choices = fit_to_context(halves[i][0], [options[k] for k in order], tokenizer, max_length)
            rows.append({"context": context, "choices": choices, "label": int(np.flatnonzero(order == 0)[0])})
        data = out_dir / "ccexp_continuation.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out_dir / "ccexp_continuation.yaml").write_text(_MC_TEMPLATE.format(task="ccexp_continuation", data=json.dumps(str(data.resolve()))))
        tasks.append("ccexp_continuation")
    return tasks


def _split_half(text: str) -> tuple[str, str]:
    """Split at the whitespace nearest the middle; the continuation keeps its leading space."""
    mid = len(text) // 2
    cut = min((k for k in range(len(text)) if text[k].isspace()), key=lambda k: abs(k - mid), default=mid)
    cut = cut if 0 < cut < len(text) - 1 else mid
    return text[:cut], text[cut:]


def run_lm_eval(model, tokenizer, task_dir: Path | None, tasks: list[str], *, batch_size: int = 16,
                max_length: int | None = None, limit: int | None = None, device: str = "cpu",
                seed: int = 0, include_path: str | None = None, errors: dict | None = None) -> dict[str, float]:
    """Evaluate ``model`` on ``tasks`` with lm-eval; return ``{"<task>/<metric>": value}``. ``task_dir``: ccexp's
    local tasks of this run; ``include_path``: a folder of the user's own task YAMLs (``eval.lm_eval.include_path``).
    A task that fails is one warning and, in ``errors["lm_eval"]``, one entry; the other tasks are kept.

    Raises:
        CcexpError: if lm-eval cannot be imported, or a task is unknown (not in ``task_dir``, not in
            ``include_path`` and not a built-in task name).
    """
    lm_eval = import_lm_eval()
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from ccexp.errors import CcexpError

    for name in ("lm_eval", "lm-eval", "lm_eval.models.huggingface"):
        logging.getLogger(name).setLevel(logging.WARNING)
    builtin = [t for t in tasks if not (task_dir and (task_dir / f"{t}.yaml").is_file())]
    paths = [str(p) for p in (task_dir, include_path) if p is not None]
    manager = TaskManager(include_path=paths or None, include_defaults=bool(builtin))
    missing = [t for t in tasks if t not in manager.all_tasks]
    if missing:
        raise CcexpError(f"lm-eval task(s) {', '.join(missing)} unknown; check eval.lm_eval.tasks")
    was_training = model.training
    model.eval()
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device, max_length=max_length)
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    failed = []
    for n, task in enumerate(tasks, start=1):  # one task at a time, so a long evaluation shows its progress
        t_task = time.perf_counter()
        try:
            results = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, limit=limit,
                                              log_samples=False, bootstrap_iters=0, random_seed=seed,
                                              numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
        except Exception as e:  # noqa: BLE001 (a task of its own making: the others are kept)
            line = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e).strip() else 'no message'}"[:300]
            failed.append(f"{task} ({line})")
            log.warning("lm-eval: task %d/%d %s failed (%s); the other tasks are kept", n, len(tasks), task, line)
            continue
        for name, metrics in results["results"].items():
            for key, value in metrics.items():
                if "stderr" not in key and isinstance(value, (int, float)):
                    out[f"{name}/{key.split(',')[0]}"] = float(value)
        now = time.perf_counter()
        log.info("lm-eval: task %d/%d %s done in %.0f s (%.0f s so far)", n, len(tasks), task, now - t_task, now - t0)
    model.train(was_training)
    if failed and errors is not None:
        errors["lm_eval"] = f"{len(failed)} of {len(tasks)} task(s) failed: " + "; ".join(failed)
    return out


def evaluate(lcfg, model, tokenizer, heldout_texts: list[str], heldout_labels: dict[str, list[str]],
             run_dir: Path, errors: dict | None = None) -> dict[str, Any]:
    """The ``eval.lm_eval`` step of a run (``lcfg``: that node): local tasks for the corpus plus any configured
    standard tasks."""
    tasks: list[str] = []
    task_dir = None
    max_length = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    if lcfg.local_tasks:
        task_dir = run_dir / "lm_eval_tasks"
        label = lcfg.label_field if lcfg.label_field in heldout_labels else None
        tasks += write_local_tasks(task_dir, heldout_texts, heldout_labels[label] if label else None,
                                   max_docs_per_task=lcfg.max_docs_per_task, mc_docs=lcfg.mc_docs, seed=int(lcfg.seed),
                                   tokenizer=tokenizer, max_length=max_length)
    tasks += list(lcfg.tasks)
    device = str(next(model.parameters()).device)
    include = lcfg.get("include_path")
    return run_lm_eval(model, tokenizer, task_dir, tasks, batch_size=lcfg.batch_size, max_length=max_length,
                       limit=lcfg.limit, device=device, seed=int(lcfg.seed),
                       include_path=str(Path(str(include)).expanduser()) if include is not None else None,
                       errors=errors)


def import_lm_eval():
    """The ``lm_eval`` package and its Hugging Face adapter, imported.

    Raises:
        CcexpError: in one line when either cannot be imported (not installed, or a broken install), naming the
            install command and ``eval.lm_eval=null``.
    """
    from ccexp.errors import CcexpError

    try:
        import lm_eval
        import lm_eval.models.huggingface  # noqa: F401  (HFLM: what ccexp wraps the trained model in)
        import lm_eval.tasks  # noqa: F401
    except Exception as e:  # an ImportError, or whatever a half-installed package raises while importing
        raise CcexpError(f"eval.lm_eval needs the lm-eval package, which cannot be imported here "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}); install it "
                         "(scripts/setup.sh, or pip install 'lm-eval[hf]==0.4.13') or turn lm-eval off with "
                         "eval.lm_eval=null") from None
    return lm_eval


@functools.lru_cache(maxsize=8)
def task_manager(include_path: str | None, defaults: bool = True):
    """lm-eval's ``TaskManager`` over ``include_path`` (a folder of task YAMLs, or None) and, with ``defaults``, its
    built-in tasks; one per process and arguments (indexing the built-in tasks reads thousands of YAMLs)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=defaults)


def check_lm_eval(lcfg) -> None:
    """Refuse, before any work, an lm-eval setting that would fail after training (``lcfg``: the ``eval.lm_eval``
    node): lm-eval not importable ([`import_lm_eval`][ccexp.evaluation.lm_eval_bridge.import_lm_eval]), an
    ``include_path`` that is not a folder, a task given as a path, and a task that is neither built in nor in
    ``include_path``, or whose data is not in the local cache (ccexp never downloads at run time): lm-eval builds
    each task offline here, as the run would after training.

    Raises:
        CcexpError: naming the setting or task and what is missing.
    """
    import os

    from ccexp.errors import CcexpError

    import_lm_eval()
    include = lcfg.get("include_path")
    if include is not None and not Path(str(include)).expanduser().is_dir():
        raise CcexpError(f"eval.lm_eval.include_path={include!r} is not a folder; give the folder of your lm-eval task "
                         "YAMLs (lm-eval's --include_path)")
    tasks = list(lcfg.tasks)
    for name in tasks:
        if "/" in name or name.endswith((".yaml", ".yml")):
            raise CcexpError(f"eval.lm_eval.tasks: {name!r} is a path; put the folder of its YAML in "
                             "eval.lm_eval.include_path and name the task (its `task:` field) in eval.lm_eval.tasks")
    if not tasks:
        return
    from lm_eval.tasks import get_task_dict

    for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        os.environ.setdefault(key, "1")
    folder = str(Path(str(include)).expanduser()) if include is not None else None
    manager = task_manager(folder, defaults=False) if folder is not None else None
    if manager is None or any(name not in manager.all_tasks for name in tasks):
        manager = task_manager(folder, defaults=True)  # lm-eval's own ~10,000 tasks: ~10 s to index, once a process
    for name in tasks:
        if name not in manager.all_tasks:
            where = f"built in or in eval.lm_eval.include_path={include}" if include is not None else \
                "built in (a task of your own: put its folder in eval.lm_eval.include_path)"
            raise CcexpError(f"eval.lm_eval.tasks: {name!r} is not an lm-eval task {where}; check the name "
                             "(`lm_eval --tasks list`)")
        try:
            get_task_dict([name], manager)
        except Exception as e:
            rest = [t for t in tasks if t != name]
            raise CcexpError(f"eval.lm_eval.tasks: {name!r} cannot be built offline ({str(e).splitlines()[0][:160]}); "
                             "put its dataset in the local Hugging Face cache first, or drop the task: "
                             f"eval.lm_eval.tasks=[{','.join(rest)}]") from None
