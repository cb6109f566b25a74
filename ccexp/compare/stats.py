"""The statistics of a comparison between samplers: paired differences, their confidence interval, a
verdict, signal and noise, and how many seeds a decision needs.

A comparison pairs each sampler's run with the baseline's run of the same seed (the same
initialisation and, by default, the same clustering), so the variance the two share cancels.
Definitions, for one metric:

* paired difference ``d_i = x_i − b_i`` over the ``n`` seeds both have; its 95 % confidence interval is
  ``mean(d) ± t_{0.975, n−1} · sd(d) / √n`` (Student's t);
* verdict: *better* / *worse* when the interval excludes 0 (in the direction the metric prefers),
  else *unresolved*;
* noise: the seed-to-seed standard deviation within a sampler, pooled over the samplers
  (``√ mean_s var_s``), as a share of the grand mean; signal: the spread between the samplers' means
  (``max − min``), as a share of the grand mean; their ratio is the signal-to-noise ratio of
  Heineman et al. 2025 ("Signal and Noise", arXiv 2508.13144, §3: relative dispersion over relative
  standard deviation);
* seeds needed: the smallest ``n`` for which a two-sided paired t-test at level ``α`` detects a true
  difference ``δ`` with probability ``power``, given ``sd(d)`` — exactly, from the noncentral t
  distribution (power(n) = P(|T| > t_{1−α/2, n−1}), ``T ~ t'(n−1, √n · δ / sd)``), which the
  textbook normal approximation ``n ≈ (z_{1−α/2} + z_{power})² (sd/δ)² + z²_{1−α/2}/2`` (Guenther
  1981) matches within one seed; and the smallest ``n`` whose interval half-width is at most a target.
"""
from __future__ import annotations

import math

import numpy as np

MAX_SEEDS = 100_000  # the search for "seeds needed" stops here (reported as more than this)


def sample_sd(values) -> float:
    """The sample standard deviation (n − 1 in the denominator) of float[n] ``values``, n >= 2; exactly 0 when
    every value is the same (NumPy's two-pass formula leaves rounding noise, 8.4e-17 for three 0.2s)."""
    x = np.asarray(values, dtype=float)
    return 0.0 if np.ptp(x) == 0 else float(x.std(ddof=1))


def mean_ci(values, level: float = 0.95) -> tuple[float, float]:
    """Mean and half-width of the ``level`` confidence interval (Student's t) of float[n] ``values``; half-width NaN
    for n < 2 (one row of [`mean_ci_rows`][ccexp.compare.stats.mean_ci_rows])."""
    mean, half = mean_ci_rows(np.asarray(values, dtype=float).reshape(1, -1), level)
    return float(mean[0]), float(half[0])


def mean_ci_rows(diffs, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """[`mean_ci`][ccexp.compare.stats.mean_ci] of every row at once: ``diffs`` float[..., n] (the seeds on the last
    axis), the means and half-widths float[...]; half-width NaN where n < 2, exactly 0 where a row's values are all
    the same (its mean is then that value)."""
    from scipy import stats

    x = np.asarray(diffs, dtype=float)
    mean, sd = _mean_sd_rows(x)
    n = x.shape[-1]
    return mean, sd * (stats.t.ppf(0.5 + level / 2, n - 1) / math.sqrt(n) if n >= 2 else math.nan)


def _mean_sd_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's mean and sample SD (n − 1) over the last axis, as [`sample_sd`][ccexp.compare.stats.sample_sd]
    takes them: exactly the value and 0 for a row of one value repeated; NaN mean for n = 0, NaN SD for n < 2."""
    n = x.shape[-1]
    if n == 0:
        return np.full(x.shape[:-1], math.nan), np.full(x.shape[:-1], math.nan)
    same = np.ptp(x, axis=-1) == 0
    mean = np.where(same, x[..., 0], x.mean(axis=-1))
    sd = np.where(same, 0.0, x.std(axis=-1, ddof=1)) if n >= 2 else np.full(mean.shape, math.nan)
    return mean, sd


def decided(mean, half) -> np.ndarray:
    """bool[...]: the interval ``mean ± half`` excludes 0, so [`verdict`][ccexp.compare.stats.verdict] says better or
    worse (False for a NaN mean or half-width)."""
    mean, half = np.asarray(mean, dtype=float), np.asarray(half, dtype=float)
    with np.errstate(invalid="ignore"):
        return ~(np.isnan(mean) | np.isnan(half)) & (np.abs(mean) > half)


def paired_p(diffs) -> np.ndarray:
    """float[...]: the two-sided p-value of the paired t-test (mean of the differences 0) for each row of ``diffs``
    float[..., n], n >= 2; 0 for a row of one nonzero value repeated, 1 for a row of zeros, NaN for n < 2. It is
    below ``1 − level`` exactly where the interval of [`mean_ci_rows`][ccexp.compare.stats.mean_ci_rows] excludes 0."""
    from scipy import stats

    x = np.asarray(diffs, dtype=float)
    n = x.shape[-1]
    if n < 2:
        return np.full(x.shape[:-1], math.nan)
    mean, sd = _mean_sd_rows(x)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(sd > 0, mean / (sd / math.sqrt(n)), np.where(mean == 0, 0.0, np.inf))
    return 2 * stats.t.sf(np.abs(t), n - 1)


def family_level(level: float, comparisons: int) -> float:
    """The per-comparison confidence level that keeps the chance of any false call among ``comparisons`` at most
    ``1 − level`` (Bonferroni): ``1 − (1 − level) / comparisons``. The verdict uses it for the primary metric's
    comparisons, one per sampler against the baseline (a family of ``comparisons`` >= 1).

    Raises:
        ValueError: for ``comparisons`` < 1 or ``level`` outside (0, 1).
    """
    if comparisons < 1 or not 0 < level < 1:
        raise ValueError(f"level={level}, comparisons={comparisons}: need level in (0, 1) and comparisons >= 1")
    return 1 - (1 - level) / comparisons


def fdr_decisions(pvalues, q: float = 0.05) -> np.ndarray:
    """bool[m]: which of ``pvalues`` float[m] the Benjamini–Hochberg step-up procedure calls at false discovery rate
    ``q`` (Benjamini & Hochberg 1995, J. R. Stat. Soc. B 57:289; ``scipy.stats.false_discovery_control``); NaN
    p-values are never called and do not count among the m."""
    from scipy import stats

    p = np.asarray(pvalues, dtype=float)
    out = np.zeros(p.shape, dtype=bool)
    known = ~np.isnan(p)
    if known.any():
        out[known] = stats.false_discovery_control(p[known], method="bh") <= q
    return out


def fcr_level(q: float, selected: int, comparisons: int) -> float:
    """The confidence level of the intervals shown beside Benjamini–Hochberg decisions: ``1 − R·q/m`` for ``R``
    comparisons called out of ``m`` (``1 − q/m`` when none is), which keeps the false coverage-statement rate of the
    called intervals at most ``q`` and makes each interval exclude 0 exactly where its comparison is called
    (Benjamini & Yekutieli 2005, "False discovery rate-adjusted multiple confidence intervals", JASA 100:71, §2).

    Raises:
        ValueError: for ``comparisons`` < 1, ``selected`` outside [0, comparisons] or ``q`` outside (0, 1).
    """
    if comparisons < 1 or not 0 <= selected <= comparisons or not 0 < q < 1:
        raise ValueError(f"q={q}, selected={selected}, comparisons={comparisons}")
    return 1 - max(selected, 1) * q / comparisons


def verdict(mean: float, half: float, lower_is_better: bool = True) -> str:
    """``better`` / ``worse`` when the interval ``mean ± half`` of (sampler − baseline) excludes 0,
    else ``unresolved`` (also for a NaN half-width: one pair)."""
    if math.isnan(half) or math.isnan(mean) or abs(mean) <= half:
        return "unresolved"
    return "better" if (mean < 0) == lower_is_better else "worse"


def seeds_to_detect(delta: float, sd: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """The smallest number of paired seeds ``n >= 2`` for which a two-sided paired t-test at level
    ``alpha`` has at least ``power`` to detect a true mean difference ``delta`` when the differences have
    standard deviation ``sd`` (exact, noncentral t; see the module docstring).

    Returns:
        n, or ``MAX_SEEDS + 1`` when even ``MAX_SEEDS`` do not suffice (``delta`` is 0 or tiny).

    Raises:
        ValueError: for a NaN or negative ``sd``, or ``alpha``/``power`` outside (0, 1).
    """
    from scipy import stats

    if not (sd >= 0) or not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"sd={sd}, alpha={alpha}, power={power}: need sd >= 0 and alpha, power in (0, 1)")
    delta = abs(float(delta))
    if sd == 0:
        return 2 if delta > 0 else MAX_SEEDS + 1
    if delta == 0:
        return MAX_SEEDS + 1

    def achieved(n: int) -> float:
        crit = stats.t.ppf(1 - alpha / 2, n - 1)
        nc = math.sqrt(n) * delta / sd
        # the far tail (nc > 0) is negligible; scipy's nct.cdf returns NaN there at 1-2 degrees of freedom and a large
        # nc (scipy 1.17: cdf(-12.7, 1, 11.3)), which must not count as enough power; a NaN power is not enough
        far = float(stats.nct.cdf(-crit, n - 1, nc))
        power = float(stats.nct.sf(crit, n - 1, nc)) + (0.0 if math.isnan(far) else far)
        return 0.0 if math.isnan(power) else power

    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    guess = max(2, int((z * sd / delta) ** 2))  # the normal approximation: start just below the answer
    if guess > MAX_SEEDS:
        return MAX_SEEDS + 1
    n = guess
    while n > 2 and achieved(n - 1) >= power:
        n -= 1
    while achieved(n) < power:
        n += 1
        if n > MAX_SEEDS:
            return MAX_SEEDS + 1
    return n


def seeds_for_half_width(sd: float, half: float, level: float = 0.95) -> int:
    """The smallest ``n >= 2`` with ``t_{(1+level)/2, n−1} · sd / √n <= half``: the seeds for a confidence
    interval at most ``half`` wide on each side, if the differences keep standard deviation ``sd``.

    Returns:
        n, or ``MAX_SEEDS + 1`` when even ``MAX_SEEDS`` do not suffice.

    Raises:
        ValueError: for a NaN or negative ``sd`` or a ``half`` <= 0.
    """
    from scipy import stats

    if not (sd >= 0) or not half > 0:
        raise ValueError(f"sd={sd}, half={half}: need sd >= 0 and half > 0")
    if sd == 0:
        return 2
    z = stats.norm.ppf(0.5 + level / 2)
    n = max(2, int((z * sd / half) ** 2))  # t > z, so the answer is at least this
    while stats.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n) > half:
        n += 1
        if n > MAX_SEEDS:
            return MAX_SEEDS + 1
    return n


def signal_and_noise(groups: dict[str, list[float]]) -> dict[str, float]:
    """Signal, noise and their ratio for one metric over samplers (``groups``: sampler -> one value per
    seed). ``noise`` is the pooled seed-to-seed standard deviation over the samplers with two seeds or
    more, ``signal`` the spread (max − min) of the samplers' means; ``*_rel`` are shares of the grand
    mean, and ``snr = signal / noise`` (NaN without noise or without two samplers)."""
    means = {g: float(np.mean(v)) for g, v in groups.items() if len(v)}
    variances = [sample_sd(v) ** 2 for v in groups.values() if len(v) >= 2]
    grand = float(np.mean(list(means.values()))) if means else math.nan
    noise = math.sqrt(float(np.mean(variances))) if variances else math.nan
    signal = max(means.values()) - min(means.values()) if len(means) >= 2 else math.nan
    snr = signal / noise if noise and not math.isnan(noise) and not math.isnan(signal) else math.nan
    return {"noise": noise, "signal": signal, "snr": snr, "noise_rel": noise / grand if grand else math.nan,
            "signal_rel": signal / grand if grand else math.nan, "mean": grand}
