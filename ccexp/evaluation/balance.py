"""The balance report: evidence of how the run's data was balanced, for a reader or an auditor.

For one run it compares the corpus cluster mix (training documents per cluster, ``n_c / N``) with
the mix actually trained on (documents drawn per cluster), over the whole run and over time; shows
how often documents were repeated; and plots per-cluster held-out perplexity against cluster size.
Output: PNG plots and a Markdown summary (logged as MLflow artifacts by the pipeline).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_balance_report(out_dir: Path, *, name: str, sizes: np.ndarray, exposure: np.ndarray,
                         history_steps: np.ndarray, history: np.ndarray, repetition_hist: dict[int, int],
                         heldout_ppl: np.ndarray, heldout_docs: np.ndarray, metrics: dict[str, float]) -> list[Path]:
    """Write ``mix.png``, ``mix_over_time.png``, ``repetition.png``, ``ppl_vs_size.png`` and
    ``balance.md`` into ``out_dir``; return their paths.

    Args:
        sizes: int64[K] training documents per cluster; exposure: int64[K] documents drawn.
        history_steps: int64[T]; history: int64[T, K] cumulative documents drawn at those steps.
        repetition_hist: number of documents drawn r times, for each r (0 included).
        heldout_ppl: float[K] (NaN where a cluster has no held-out document); heldout_docs: int64[K].
        metrics: the run's evaluation metrics (``ppl``, ``ppl_macro``, ...).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus_mix = sizes / sizes.sum()
    trained_mix = exposure / max(1, exposure.sum())
    k_active = np.count_nonzero(sizes)
    order = np.argsort(-sizes, kind="stable")
    paths = [_plot_mix(out_dir / "mix.png", name, corpus_mix[order], trained_mix[order], k_active),
             _plot_mix_over_time(out_dir / "mix_over_time.png", name, history_steps, history, corpus_mix, k_active),
             _plot_repetition(out_dir / "repetition.png", name, repetition_hist, sizes, exposure),
             _plot_ppl_vs_size(out_dir / "ppl_vs_size.png", name, sizes, heldout_ppl, heldout_docs)]
    md = _write_balance_md(out_dir / "balance.md", name, sizes=sizes, exposure=exposure, corpus_mix=corpus_mix,
                           trained_mix=trained_mix, repetition_hist=repetition_hist, metrics=metrics)
    return paths + [md]


def _plot_mix(path: Path, name: str, corpus_mix: np.ndarray, trained_mix: np.ndarray, k_active: int) -> Path:
    """Write ``mix.png``: each cluster's corpus share beside its trained share (mixes given largest cluster first)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4))
    x = np.arange(corpus_mix.size)
    ax.bar(x - 0.2, corpus_mix, width=0.4, label="corpus (n_c / N)")
    ax.bar(x + 0.2, trained_mix, width=0.4, label="trained on (drawn_c / D)")
    ax.axhline(1 / k_active, color="gray", lw=0.8, ls="--", label="uniform (1/K)")
    ax.set(xlabel="cluster (largest first)", ylabel="share of documents", title=f"{name}: cluster mix")
    ax.legend()
    return _save(fig, path)


def _plot_mix_over_time(path: Path, name: str, history_steps: np.ndarray, history: np.ndarray,
                        corpus_mix: np.ndarray, k_active: int) -> Path:
    """Write ``mix_over_time.png``: KL of the drawn mix from the corpus mix and from uniform, per step."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4))
    if len(history):
        totals = history.sum(axis=1, keepdims=True).clip(min=1)
        q = history / totals
        with np.errstate(divide="ignore", invalid="ignore"):
            kl_corpus = np.nansum(np.where(q > 0, q * np.log(q / np.where(corpus_mix > 0, corpus_mix, 1)), 0), axis=1)
            kl_uniform = np.nansum(np.where(q > 0, q * np.log(q * k_active), 0), axis=1)
        ax.plot(history_steps, kl_corpus, label="KL(trained mix || corpus mix)")
        ax.plot(history_steps, kl_uniform, label="KL(trained mix || uniform)")
    ax.set(xlabel="optimizer step", ylabel="KL divergence (nats)",
           title=f"{name}: cluster mix of the documents drawn so far")
    ax.legend()
    return _save(fig, path)


def _plot_repetition(path: Path, name: str, repetition_hist: dict[int, int], sizes: np.ndarray,
                     exposure: np.ndarray) -> Path:
    """Write ``repetition.png``: documents per number of draws, and documents drawn per cluster by size."""
    from matplotlib.ticker import MaxNLocator

    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    reps = np.array(sorted(repetition_hist))
    counts = [repetition_hist[r] for r in reps]
    a1.bar(reps, counts)
    a1.set_yscale("log")
    a1.set_ylim(0.8, max(counts, default=1) * 4)  # bars start below 1; room above the tallest for its count
    for r, n in zip(reps, counts):
        a1.annotate(f"{n:,}", (r, n), ha="center", va="bottom", fontsize=8)
    a1.set(xlabel="times a document was drawn", ylabel="documents (log scale)", title="repetition")
    a1.xaxis.set_major_locator(MaxNLocator(integer=True))
    nz = sizes > 0
    a2.scatter(sizes[nz], exposure[nz], s=12)
    a2.set(xscale="log", xlabel="cluster size (training documents, log scale)", ylabel="documents drawn",
           title="exposure per cluster", ylim=(0, max(1, int(exposure[nz].max(initial=0))) * 1.05))  # from 0
    a2.yaxis.set_major_locator(MaxNLocator(integer=True))
    _plain_log_ticks(a2.xaxis)
    fig.suptitle(name)
    return _save(fig, path)


def _plot_ppl_vs_size(path: Path, name: str, sizes: np.ndarray, heldout_ppl: np.ndarray,
                      heldout_docs: np.ndarray) -> Path:
    """Write ``ppl_vs_size.png``: each cluster's held-out perplexity against its size (area: held-out documents)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ok = np.isfinite(heldout_ppl) & (sizes > 0)

    def marker(docs):
        return 8 + 4 * np.sqrt(docs)

    ax.scatter(sizes[ok], heldout_ppl[ok], s=marker(heldout_docs[ok]), alpha=0.7)
    top = int(heldout_docs[ok].max()) if ok.any() else 1
    for docs in sorted({1, max(1, top // 10), top}):  # a legend for the marker sizes
        ax.scatter([], [], s=marker(docs), color="C0", alpha=0.7, label=f"{docs} held-out document{'s' * (docs > 1)}")
    ax.legend(loc="best", fontsize=8, title="marker area", title_fontsize=8)
    ax.set(xscale="log", xlabel="cluster size (training documents, log scale)",
           ylabel="held-out perplexity (cluster's documents)", title=f"{name}: perplexity vs cluster size")
    return _save(fig, path)


def _write_balance_md(path: Path, name: str, *, sizes: np.ndarray, exposure: np.ndarray, corpus_mix: np.ndarray,
                      trained_mix: np.ndarray, repetition_hist: dict[int, int], metrics: dict[str, float]) -> Path:
    """Write ``balance.md``: the mix and repetition figures and the held-out metrics table."""
    nz = sizes > 0
    k_active = np.count_nonzero(sizes)
    reps = np.array(sorted(repetition_hist))
    never = repetition_hist.get(0, 0)
    total_docs = sum(repetition_hist.values())
    lines = [f"# Balance report: {name}", "",
             f"- Clusters: {k_active} non-empty of {sizes.size}; training documents: {int(sizes.sum()):,}",
             f"- Documents drawn: {int(exposure.sum()):,}; never drawn: {never:,} of {total_docs:,} "
             f"({never / max(1, total_docs):.1%}); most repeated: {max(reps) if len(reps) else 0}x",
             f"- Smallest / largest cluster share: corpus {corpus_mix[nz].min():.4f} / {corpus_mix.max():.4f}, "
             f"trained {trained_mix[nz].min():.4f} / {trained_mix.max():.4f} (uniform = {1 / k_active:.4f})",
             ""]
    keys = [k for k in ("ppl", "ppl_macro", "ppl_worst", "ppl_rare", "ppl_common") if k in metrics]
    lines += ["| held-out metric | value |", "|---|---:|"] + [f"| {k} | {metrics[k]:.2f} |" for k in keys]
    lines += ["", "Plots: `mix.png` (corpus vs trained mix), `mix_over_time.png`, `repetition.png`, "
              "`ppl_vs_size.png`.", ""]
    path.write_text("\n".join(lines))
    return path

def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_cluster_table(path: Path, *, sizes: np.ndarray, exposure: np.ndarray, loss_sum: np.ndarray,
                        loss_tokens: np.ndarray, per_cluster: dict[str, np.ndarray],
                        average_weights: np.ndarray | None = None, given_weights: np.ndarray | None = None,
                        given_unit: str = "tokens") -> Path:
    """``clusters.csv``, one row per cluster: ``train_size`` (training documents), ``exposure``
    (documents drawn), ``train_tokens`` / ``token_share`` / ``train_loss_mean`` (tokens trained on, their
    share of the run's, their mean loss in nats), ``heldout_docs``, ``heldout_tokens``, ``heldout_ppl``.

    A policy given a mixture (``given_weights``, float[K]: ``sampler=mixture``) adds ``given_token_share``
    (or ``given_document_share`` for ``given_unit="documents"``) and ``average_weight``, the *realised*
    token share — which differs from the given one where ``max_repetitions`` bound. A learning policy
    (``average_weights``, float[K] token shares: ODM, DoReMi) adds ``average_weight``, its weights averaged
    over training. ``average_weight`` is what ``sampler.weights=<this run's folder>`` reuses: the token
    shares the run trained on (given or learned), never weights it did not train on."""
    import csv

    share = loss_tokens / max(1, int(np.sum(loss_tokens)))
    if given_weights is not None:
        average_weights = share  # a given mix: what was trained on, after any cap
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["cluster", "train_size", "exposure", "train_tokens", "token_share", "train_loss_mean",
                    "heldout_docs", "heldout_tokens", "heldout_ppl"]
                   + ([f"given_{'token' if given_unit == 'tokens' else 'document'}_share"] if given_weights is not None else [])
                   + (["average_weight"] if average_weights is not None else []))
        for c in range(int(sizes.size)):
            w.writerow([c, int(sizes[c]), int(exposure[c]), int(loss_tokens[c]), f"{share[c]:.6f}",
                        f"{loss_sum[c] / loss_tokens[c]:.5f}" if loss_tokens[c] else "",
                        int(per_cluster["documents"][c]), int(per_cluster["tokens"][c]),
                        f"{per_cluster['ppl'][c]:.4f}" if per_cluster["tokens"][c] else ""]
                       + ([f"{given_weights[c]:.6f}"] if given_weights is not None else [])
                       + ([f"{average_weights[c]:.6f}"] if average_weights is not None else []))
    return path


def write_label_table(path: Path, *, label: str, names: list[str], train_docs: np.ndarray, loss_sum: np.ndarray,
                      tokens: np.ndarray, metrics: dict[str, float]) -> Path:
    """``label_<label>.csv``, one row per value of the label: ``train_docs`` (training documents),
    ``train_tokens`` / ``train_token_share`` / ``train_loss_mean`` (tokens trained on, their share of
    the run's, their mean loss in nats), ``heldout_docs`` and ``heldout_ppl`` (from the evaluation's
    ``heldout_docs_<label>/*`` and ``ppl_<label>/*``; empty where there are none)."""
    import csv

    from ccexp.names import safe_names

    safe = safe_names(names)
    total = max(int(tokens.sum()), 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([label, "train_docs", "train_tokens", "train_token_share", "train_loss_mean", "heldout_docs",
                    "heldout_ppl"])
        for g, name in enumerate(names):
            ppl = metrics.get(f"ppl_{label}/{safe[name]}")
            w.writerow([name, int(train_docs[g]), int(tokens[g]), f"{tokens[g] / total:.5f}",
                        f"{loss_sum[g] / tokens[g]:.5f}" if tokens[g] else "",
                        int(metrics.get(f"heldout_docs_{label}/{safe[name]}", 0)),
                        f"{ppl:.4f}" if ppl is not None and np.isfinite(ppl) else ""])
    return path


def write_label_report(out_dir: Path, *, name: str, label: str, names: list[str], train_docs: np.ndarray,
                       corpus_tokens: np.ndarray, tokens: np.ndarray, metrics: dict[str, float]) -> list[Path]:
    """Exposure and held-out perplexity per value of ``label`` (e.g. ``domain``): a "Per <label>" table
    appended to ``balance.md`` (written first: it needs no plotting) and ``label_<label>.png`` (left:
    each value's share of the training split's tokens — after any dedup or selection — beside its
    share of the tokens trained on; right: its held-out perplexity, "no held-out documents" where
    there are none). Values are drawn as literal text, cut at 40 characters. Returns the paths written.

    Args:
        names: the label's values (V); train_docs: int64[V] training documents; corpus_tokens: float[V]
        their tokens; tokens: int64[V] tokens trained on; metrics: the run's evaluation metrics
        (``ppl_<label>/<value>``).
    """
    from ccexp.names import markdown_cell, plot_text, safe_names

    out_dir.mkdir(parents=True, exist_ok=True)
    safe = safe_names(names)
    corpus_share = corpus_tokens / max(1.0, float(corpus_tokens.sum()))
    token_share = tokens / max(1, int(tokens.sum()))
    ppl = np.array([metrics.get(f"ppl_{label}/{safe[v]}", np.nan) for v in names], dtype=float)
    order = np.argsort(-corpus_share, kind="stable")
    lines = ["", f"## Per {markdown_cell(label)}", "", f"Plot: `label_{label}.png`.", "", f"| {markdown_cell(label)} | training docs | share of training "
             "tokens | share of tokens trained | held-out ppl |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {markdown_cell(names[i], 80)} | {int(train_docs[i]):,} | {corpus_share[i]:.4f} | {token_share[i]:.4f} | "
              + (f"{ppl[i]:.2f} |" if np.isfinite(ppl[i]) else "no held-out documents |") for i in order]
    md = out_dir / "balance.md"
    with open(md, "a") as f:
        f.write("\n".join(lines) + "\n")

    plt = _plt()
    y = np.arange(len(names))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 1.6 + 0.32 * len(names)), sharey=True, layout="constrained")
    a1.barh(y - 0.2, corpus_share[order], height=0.4, label="training split (after any dedup / selection)")
    a1.barh(y + 0.2, token_share[order], height=0.4, label="tokens trained on (this run)")
    a1.set(yticks=y, yticklabels=[plot_text(names[i]) for i in order], xlabel="share of tokens (fraction of the total)",
           title=f"{plot_text(label)}: training split vs trained mix, in tokens")
    a1.invert_yaxis()
    finite = np.isfinite(ppl[order])
    a2.barh(y[finite], ppl[order][finite], color="C2")
    for row in y[~finite]:
        a2.text(0, row, " no held-out documents", va="center", fontsize=8, color="gray")
    a2.set(xlabel="held-out perplexity (value's documents)", title=f"{plot_text(label)}: held-out perplexity")
    fig.suptitle(plot_text(name, 80))
    fig.legend(loc="outside lower center", ncols=2, fontsize=8)
    png = out_dir / f"label_{label}.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return [png]


def write_document_table(path: Path, per_document: dict[str, np.ndarray]) -> Path:
    """``heldout_documents.csv``: one row per held-out document — its corpus index, cluster, scored tokens
    and bytes, and summed NLL in nats under the headline weights — for paired bootstraps over the
    held-out sample (two runs' rows pair by document)."""
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["document", "cluster", "tokens", "bytes", "nll"])
        w.writerows(zip(per_document["document"].tolist(), per_document["cluster"].tolist(),
                        per_document["tokens"].tolist(), per_document["bytes"].tolist(),
                        (f"{x:.6f}" for x in per_document["nll"])))
    return path


def _plain_log_ticks(axis) -> None:
    """Few plain-number ticks on a log axis (``200``, ``1,000``, not ``2x10^2``) — 1-2-5 steps over a
    narrow range, whole decades over a wide one — and no minor tick labels, so labels never run into
    each other however narrow or wide the range."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    low, high = sorted(axis.get_view_interval())
    decades = np.log10(max(high, 1e-12) / max(low, 1e-12))
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades < 2.5 else (1.0,)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def write_run_files(cfg, run_dir: Path, name: str, sizes: np.ndarray, fit, result,
                    labels: dict[str, list[str]] | None = None,
                    train_docs: np.ndarray | None = None) -> list[tuple[Path, str | None]]:
    """The run's files: ``resolved_config.yaml``, ``tables/clusters.csv``, ``tables/label_<label>.csv`` (tokens
    trained and held-out perplexity per value of the corpus's first label; ``train_docs``: int64[n], the
    training documents, in the token stream's order), ``labels/<label>.json`` (each
    label value and the name its metrics carry, [`ccexp.names.safe_names`][ccexp.names.safe_names]) and (``eval.balance_report``)
    the balance report under ``balance/`` (with the per-label plot and table, [`write_label_report`][ccexp.evaluation.balance.write_label_report]).
    Returns (path, MLflow artifact folder) pairs.

    Args:
        fit: the [`FitResult`][ccexp.training.runner.FitResult]; result: the
            [`EvalResult`][ccexp.evaluation.heldout.EvalResult].
    """
    from omegaconf import OmegaConf

    sampler, module = fit.stream.sampler, fit.module
    OmegaConf.save(cfg, run_dir / "resolved_config.yaml", resolve=True)
    table = write_cluster_table(run_dir / "tables" / "clusters.csv", sizes=sizes, exposure=sampler.exposure(),
                                loss_sum=module.cluster_loss_sum.cpu().numpy(),
                                loss_tokens=module.cluster_tokens.cpu().numpy(), per_cluster=result.per_cluster,
                                average_weights=sampler.average_weights(), given_weights=sampler.given_weights(),
                                given_unit=sampler.weight_unit)
    files: list[tuple[Path, str | None]] = [(run_dir / "resolved_config.yaml", None), (table, "tables")]
    if result.per_document is not None:
        files.append((write_document_table(run_dir / "tables" / "heldout_documents.csv", result.per_document), "tables"))
    label_counts = corpus_tokens = None
    if fit.group_field is not None and module.num_groups:
        ids = fit.group_ids if train_docs is None else fit.group_ids[train_docs]
        label_counts = np.bincount(ids, minlength=len(fit.group_names)).astype(np.int64)
        corpus_tokens = (np.bincount(ids, weights=fit.stream.stream_len, minlength=len(fit.group_names))
                         if train_docs is not None else None)
        files.append((write_label_table(run_dir / "tables" / f"label_{fit.group_field}.csv", label=fit.group_field,
                                        names=fit.group_names, train_docs=label_counts,
                                        loss_sum=module.group_loss_sum.cpu().numpy(),
                                        tokens=module.group_tokens.cpu().numpy(), metrics=result.metrics), "tables"))
    files += _write_label_names(run_dir, labels or {})
    if cfg.eval.balance_report:
        files += _write_balance_files(run_dir, name, sizes, fit, result, label_counts, corpus_tokens)
    return files


def _write_label_names(run_dir: Path, labels: dict[str, list[str]]) -> list[tuple[Path, str | None]]:
    """Write ``labels/<label>.json`` (value -> its metrics' name) per label; return (path, folder) pairs."""
    import json

    from ccexp.names import safe_names

    files: list[tuple[Path, str | None]] = []
    for label, values in labels.items():
        path = run_dir / "labels" / f"{label}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(safe_names(values), indent=1, ensure_ascii=False))
        files.append((path, "labels"))
    return files


def _write_balance_files(run_dir: Path, name: str, sizes: np.ndarray, fit, result, label_counts: np.ndarray | None,
                         corpus_tokens: np.ndarray | None) -> list[tuple[Path, str | None]]:
    """Write the balance report (and per-label part) under ``balance/``; return (path, folder) pairs."""
    from ccexp.evaluation.heldout import isolated

    sampler, module, tel = fit.stream.sampler, fit.module, fit.telemetry
    files: list[tuple[Path, str | None]] = []
    report = isolated("balance_report", result.errors, run_dir, write_balance_report,
                      run_dir / "balance", name=name, sizes=sizes, exposure=sampler.exposure(),
                      history_steps=np.array(tel.history_steps), history=np.array(tel.history),
                      repetition_hist=sampler.repetition_histogram(), heldout_ppl=result.per_cluster["ppl"],
                      heldout_docs=result.per_cluster["documents"], metrics=result.metrics)
    files += [(p, "balance") for p in report or []]
    if report and corpus_tokens is not None:
        extra = isolated("balance_report", result.errors, run_dir, write_label_report, run_dir / "balance",
                         name=name, label=fit.group_field, names=fit.group_names, train_docs=label_counts,
                         corpus_tokens=corpus_tokens, tokens=module.group_tokens.cpu().numpy(),
                         metrics=result.metrics)
        files += [(p, "balance") for p in extra or []]
    return files
