"""Cluster report: how balanced the clustering is, how it agrees with the corpus labels, and what
each cluster contains — so a person can see what the sampler is balancing.

* imbalance: largest/smallest non-empty cluster, Gini coefficient of the sizes (0 = equal), size
  entropy normalised by ``ln K`` (1 = equal), empty clusters;
* agreement with a label (e.g. ``domain``), via scikit-learn: normalised mutual information,
  adjusted Rand index, purity (share of documents in their cluster's majority label);
* ``sizes.png``: the size histogram on log axes; ``clusters.md`` / ``clusters.html``: per cluster its
  size, majority label and the documents nearest to the centroid (highest cosine similarity).
"""
from __future__ import annotations

import html
from pathlib import Path

import numpy as np

from ccexp.clustering.selection import closest_per_cluster
from ccexp.data.corpus import take
from ccexp.names import markdown_cell


def imbalance(sizes: np.ndarray) -> dict[str, float]:
    s = np.sort(np.asarray(sizes, dtype=np.float64))
    nz = s[s > 0]
    k = nz.size
    p = nz / nz.sum()
    gini = float((2 * np.arange(1, k + 1) - k - 1) @ nz / (k * nz.sum())) if k > 1 else 0.0
    return {"clusters": float(s.size), "empty": float(s.size - k), "largest": float(nz.max()),
            "smallest": float(nz.min()), "max_min_ratio": float(nz.max() / nz.min()), "gini": gini,
            "size_entropy_norm": float(-(p * np.log(p)).sum() / np.log(k)) if k > 1 else 1.0}


def agreement(labels: np.ndarray, values: list[str]) -> dict[str, float]:
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    _, truth = np.unique(np.asarray(values, dtype=object).astype(str), return_inverse=True)
    table = np.zeros((int(labels.max()) + 1, int(truth.max()) + 1), dtype=np.int64)
    np.add.at(table, (labels, truth), 1)
    return {"nmi": float(normalized_mutual_info_score(truth, labels)),
            "ari": float(adjusted_rand_score(truth, labels)),
            "purity": float(table.max(axis=1).sum() / labels.size)}


def size_histogram(sizes: np.ndarray, bins: int = 30) -> tuple[np.ndarray, np.ndarray]:
    """Counts int64[b] of non-empty clusters per log-spaced size bin, and the bin edges float[b+1] (in
    training documents): the first edge is exactly the smallest size and the last one above the
    largest, so every cluster is counted (a float edge computed as 105.00000000000004 for a smallest
    cluster of 105 used to drop it)."""
    nz = np.asarray(sizes)[np.asarray(sizes) > 0].astype(np.float64)
    edges = np.geomspace(nz.min(), nz.max() + 1, min(bins, max(1, np.unique(nz).size)) + 1)
    edges[0], edges[-1] = nz.min(), nz.max() + 1
    counts, _ = np.histogram(nz, bins=edges)
    return counts.astype(np.int64), edges


def nearest_documents(labels: np.ndarray, similarity: np.ndarray, train_mask: np.ndarray, k: int,
                      per: int) -> list[np.ndarray]:
    """For each of the ``k`` clusters, its ``per`` training documents nearest the centroid (highest
    cosine similarity first), as corpus indices."""
    train_idx = np.flatnonzero(train_mask)
    picked = train_idx[closest_per_cluster(labels[train_idx], similarity[train_idx], k, per)]
    return np.split(picked, np.cumsum(np.bincount(labels[picked], minlength=k))[:-1])


def write_cluster_report(out_dir: Path, *, labels: np.ndarray, sizes: np.ndarray, similarity: np.ndarray,
                         texts: list[str], label_values: dict[str, list[str]], train_mask: np.ndarray,
                         samples_per_cluster: int = 3, max_clusters: int = 200, chars: int = 160,
                         title: str = "clustering") -> dict[str, float]:
    """Write the report files into ``out_dir``; return the metrics (``cluster/*`` names without prefix).

    Args:
        labels: int32[N]; sizes: int64[K] training documents per cluster; similarity: float32[N] cosine
            similarity to the centroid; texts: the N documents; label_values: name -> N values;
            train_mask: bool[N]; title: what the plot's title names (the corpus and clusterer).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = imbalance(sizes)
    train_idx = np.flatnonzero(train_mask)
    agree, majority = _label_majorities(labels, sizes, train_idx, label_values)
    metrics.update(agree)
    _plot_sizes(out_dir / "sizes.png", sizes, metrics["gini"], title)
    rows = _cluster_rows(labels, sizes, similarity, texts, train_mask, majority, per=samples_per_cluster,
                         max_clusters=max_clusters, chars=chars)
    summary = ", ".join(f"{k} {v:.3g}" for k, v in metrics.items())
    _write_markdown(out_dir / "clusters.md", sizes, summary, rows, chars)
    _write_html(out_dir / "clusters.html", summary, rows)
    return metrics


def _label_majorities(labels: np.ndarray, sizes: np.ndarray, train_idx: np.ndarray,
                      label_values: dict[str, list[str]]) -> tuple[dict[str, float], dict]:
    """Agreement metrics per label (``<name>_nmi``, ...) and per label (values, each cluster's majority, its count)."""
    metrics: dict[str, float] = {}
    majority: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for name, values in label_values.items():
        vals = np.asarray(values, dtype=object).astype(str)
        metrics.update({f"{name}_{k}": v for k, v in agreement(labels[train_idx], list(vals[train_idx])).items()})
        uniq, inv = np.unique(vals[train_idx], return_inverse=True)
        table = np.zeros((sizes.size, uniq.size), dtype=np.int64)
        np.add.at(table, (labels[train_idx], inv), 1)
        majority[name] = (uniq, table.argmax(axis=1), table.max(axis=1))
    return metrics, majority


def _plot_sizes(path: Path, sizes: np.ndarray, gini: float, title: str) -> None:
    """Write ``sizes.png``: the histogram of cluster sizes on a log axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.2))
    counts, edges = size_histogram(sizes)
    ax.stairs(counts, edges, fill=True)
    ax.set(xscale="log", xlabel="cluster size (training documents, log scale)", ylabel="clusters",
           title=f"{title}: cluster sizes\nK={sizes.size}, {int(counts.sum())} non-empty, Gini {gini:.2f}")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cluster_rows(labels: np.ndarray, sizes: np.ndarray, similarity: np.ndarray, texts: list[str],
                  train_mask: np.ndarray, majority: dict, *, per: int, max_clusters: int,
                  chars: int) -> list[tuple[int, int, str, list[str]]]:
    """(cluster, size, majority tags, ``per`` nearest documents) for the ``max_clusters`` largest clusters."""
    nearest = nearest_documents(labels, similarity, train_mask, int(sizes.size), per)
    shown = [c for c in np.argsort(-sizes, kind="stable")[:max_clusters] if sizes[c] > 0]
    wanted = np.unique(np.concatenate([nearest[c] for c in shown] + [np.zeros(0, np.int64)])).astype(np.int64)
    text_of = dict(zip(wanted.tolist(), take(texts, wanted)))  # one read per row group of a sharded corpus
    rows = []
    for c in shown:
        docs = nearest[c]
        samples = [" ".join(text_of[int(d)].split())[:chars] for d in docs]
        tags = [f"{name}: {u[a[c]]} ({m[c] / sizes[c]:.0%})" for name, (u, a, m) in majority.items()]
        rows.append((int(c), int(sizes[c]), "; ".join(tags), samples))
    return rows


def _write_markdown(path: Path, sizes: np.ndarray, summary: str, rows: list, chars: int) -> None:
    """Write ``clusters.md``: the metrics line and the table of [`_cluster_rows`][ccexp.clustering.report._cluster_rows]."""
    head = ["| cluster | size | majority label | nearest to centroid |", "|---:|---:|---|---|"]
    md = [f"# Clusters (K={sizes.size})", "", summary, "", *head]
    md += [f"| {c} | {n} | {markdown_cell(tag, len(tag))} | " + " / ".join(markdown_cell(s, chars) for s in samples)
           + " |" for c, n, tag, samples in rows]  # label values and texts are data: one line, | escaped
    path.write_text("\n".join(md) + "\n")


# the stylesheet of every HTML page ccexp writes (this report, the comparison report): readable type, a table
# with ruled cells and numbers to the right, images no wider than the page
PAGE_STYLE = ("<style>body{font-family:sans-serif;max-width:1400px;margin:1em auto;padding:0 1em;line-height:1.4}"
              "table{border-collapse:collapse;margin:0.5em 0}td,th{border:1px solid #bbb;padding:3px 6px;"
              "font-size:13px;vertical-align:top}th{background:#f0f0f0;text-align:left}"
              "td:not(:first-child){text-align:right}td.text{text-align:left}"
              "ol{margin:0;padding-left:1.4em}img{max-width:100%}pre{background:#f4f4f4;padding:8px;"
              "white-space:pre-wrap}</style>")


def _write_html(path: Path, summary: str, rows: list) -> None:
    """Write ``clusters.html``: the metrics line, ``sizes.png`` and the table of [`_cluster_rows`][ccexp.clustering.report._cluster_rows]."""
    cells = "".join(f"<tr><td>{c}</td><td>{n}</td><td class='text'>{html.escape(tag)}</td><td class='text'><ol>"
                    + "".join(f"<li>{html.escape(s)}</li>" for s in samples) + "</ol></td></tr>"
                    for c, n, tag, samples in rows)
    path.write_text(
        f"<!doctype html><meta charset='utf-8'><title>ccexp clusters</title>{PAGE_STYLE}<h1>Clusters</h1>"
        f"<p>{html.escape(summary)}</p><img src='sizes.png' alt='cluster sizes'><table>"
        f"<tr><th>cluster</th><th>size</th><th>majority label</th><th>nearest to centroid</th></tr>{cells}</table>")
