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
    """Mean and half-width of the ``level`` confidence interval (Student's t); half-width NaN for n < 2."""
    from scipy import stats

    x = np.asarray(values, dtype=float)
    if x.size < 2:
        return float(x.mean()) if x.size else math.nan, math.nan
    half = stats.t.ppf(0.5 + level / 2, x.size - 1) * sample_sd(x) / math.sqrt(x.size)
    return (float(x[0]) if np.ptp(x) == 0 else float(x.mean())), float(half)


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
        return float(stats.nct.sf(crit, n - 1, nc) + stats.nct.cdf(-crit, n - 1, nc))

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
