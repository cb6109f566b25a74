"""Does the verdict keep its error rates? The comparison code run on simulated sweeps with the noise ccexp measured.

A sweep's verdict pairs each sampler's run with the baseline's run of the same seed and calls the difference
*better* or *worse* when its interval excludes 0 (:mod:`ccexp.compare.stats`). Its error rates rest on the
differences being like draws of one distribution; ccexp's own measurements say the noise is not textbook: a
persistent per-seed offset (the paired SD grows with the budget, 7.1 → 9.0 → 12.3 % at 1×, 2× and 4×), arms whose
run-to-run spreads differ by up to 25× (marin-community/marin #2345), and perplexities, which are positive and
skewed. Each simulated comparison draws, per seed ``i`` and arm ``a``,

    x_{a,i} = μ_a + o_i + σ_a · e_{a,i}

with ``o_i`` the seed's offset (shared by the arms, as the same initialisation and clustering make it), ``σ_a``
the arm's spread (the baseline 1, the other arm ``ratio``) and ``e`` unit-variance noise: normal, Student's t with 3
degrees of freedom (heavy tails) or a centred log-normal (σ = 1: skewed like perplexities). Then:

* **identical arms** (μ equal): the share of comparisons the primary verdict calls better or worse, for 2 to 30 seeds
  (want ≤ 5 % ± 1.5 %), for one sampler against the baseline and for two (the family the report corrects for), and
  the share of comparisons where at least one of seven null secondary metrics (correlated 0.5) is called better or
  worse after the report's correction;
* **a planted effect** equal to the minimum effect the report sizes for: at the seeds the report says are needed
  (:func:`ccexp.compare.stats.seeds_to_detect` with the true spread), the share decided the right way (want ≥ 80 %);
* **seeds needed after 3 seeds**: the report's estimate from a 3-seed pilot against the seed count at which a sweep
  grown one seed at a time first excludes 0.

Writes ``docs/measured/verdict_calibration.json`` (``--out``). Usage::

    python benches/bench_verdict_calibration.py            # 20,000 comparisons per cell
    python benches/bench_verdict_calibration.py --sims 4000
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from ccexp.compare import stats

ROOT = Path(__file__).resolve().parents[1]
SEEDS = (2, 3, 4, 5, 8, 10, 15, 20, 30)
RATIOS = (1.0, 5.0, 25.0)
TAILS = ("normal", "t3", "lognormal")
ALPHA = 0.05


def noise(rng: np.random.Generator, tail: str, shape) -> np.ndarray:
    """Unit-variance, mean-0 noise of ``shape``: ``normal``, ``t3`` (Student's t, 3 df) or ``lognormal`` (σ = 1)."""
    if tail == "normal":
        return rng.standard_normal(shape)
    if tail == "t3":
        return rng.standard_t(3, shape) / math.sqrt(3.0)
    x = rng.lognormal(0.0, 1.0, shape)
    return (x - math.exp(0.5)) / math.sqrt((math.e - 1) * math.e)


def differences(rng, tail: str, ratio: float, n: int, sims: int, effect: float = 0.0, arms: int = 1) -> np.ndarray:
    """float64[sims, arms, n]: paired differences (arm − baseline) of ``arms`` samplers against one baseline, the
    seed offsets drawn and cancelled as the pairing cancels them; ``effect`` is each arm's true mean difference."""
    offset = 0.3 * rng.standard_normal((sims, 1, n))
    base = offset + noise(rng, tail, (sims, 1, n))
    arm = offset + effect + ratio * noise(rng, tail, (sims, arms, n))
    return arm - base


def called(diffs: np.ndarray, level: float) -> np.ndarray:
    """bool[...]: the verdict is better or worse (the interval at ``level`` excludes 0) for each comparison, with the
    report's own interval (:func:`ccexp.compare.stats.mean_ci`) and verdict (:func:`ccexp.compare.stats.verdict`)."""
    mean, half = stats.mean_ci_rows(diffs, level=level)
    return stats.decided(mean, half)


def identical_arms(rng, sims: int) -> list[dict]:
    rows = []
    for tail in TAILS:
        for ratio in RATIOS:
            for n in SEEDS:
                one = called(differences(rng, tail, ratio, n, sims)[:, 0], 1 - ALPHA)
                two = differences(rng, tail, ratio, n, sims, arms=2)
                level = stats.family_level(1 - ALPHA, 2)
                family = called(two, level).any(axis=1)
                rows.append({"tail": tail, "spread_ratio": ratio, "seeds": n, "false_positive_one_sampler": float(one.mean()),
                             "false_positive_two_samplers_any": float(family.mean())})
    return rows


def secondary_family(rng, sims: int, metrics: int = 7, rho: float = 0.5) -> list[dict]:
    """The share of null comparisons with any of ``metrics`` correlated secondary metrics called, uncorrected and
    after the report's correction (:func:`ccexp.compare.stats.fdr_decisions`)."""
    rows = []
    for tail in TAILS:
        for n in (3, 5, 10, 30):
            shared = differences(rng, tail, 5.0, n, sims)[:, 0]
            own = np.stack([differences(rng, tail, 5.0, n, sims)[:, 0] for _ in range(metrics)], axis=1)
            d = math.sqrt(rho) * shared[:, None, :] + math.sqrt(1 - rho) * own
            raw = called(d, 1 - ALPHA).any(axis=1)
            p = stats.paired_p(d)
            corrected = np.array([stats.fdr_decisions(row, ALPHA).any() for row in p])
            rows.append({"tail": tail, "seeds": n, "metrics": metrics, "any_called_uncorrected": float(raw.mean()),
                         "any_called_corrected": float(corrected.mean())})
    return rows


def planted_effect(rng, sims: int) -> list[dict]:
    rows = []
    for tail in TAILS:
        for ratio in RATIOS:
            sd = math.sqrt(1 + ratio ** 2)
            for size in (0.5, 1.0, 2.0):  # the effect in units of the differences' SD
                effect = -size * sd  # lower is better: the arm is better by the minimum effect
                n = stats.seeds_to_detect(effect, sd, alpha=ALPHA, power=0.8)
                mean, half = stats.mean_ci_rows(differences(rng, tail, ratio, n, sims, effect)[:, 0], level=1 - ALPHA)
                right = stats.decided(mean, half) & (mean < 0)  # better: lower is better
                rows.append({"tail": tail, "spread_ratio": ratio, "effect_in_sd": size, "seeds_needed": n,
                             "decided_right": float(right.mean())})
    return rows


def pilot_estimate(rng, sims: int, most: int = 400) -> list[dict]:
    """The seeds the report says a 3-seed pilot needs (to detect the planted minimum effect) against the seed count
    at which the same sweep, grown a seed at a time, first excludes 0."""
    rows = []
    for tail in TAILS:
        for size in (0.5, 1.0):
            sd = math.sqrt(2.0)
            effect = -size * sd
            d = differences(rng, tail, 1.0, most, sims, effect)[:, 0]
            estimate = np.array([stats.seeds_to_detect(effect, stats.sample_sd(row[:3]), power=0.8) for row in d])
            first = np.full(sims, most + 1)
            for n in range(2, most + 1):
                mean, half = stats.mean_ci_rows(d[:, :n], level=1 - ALPHA)
                hit = stats.decided(mean, half) & (mean < 0) & (first > most)  # decided, and the right way
                first[hit] = n
            truth = stats.seeds_to_detect(effect, sd, power=0.8)
            rows.append({"tail": tail, "effect_in_sd": size, "seeds_needed_true_sd": truth,
                         "pilot_estimate_median": float(np.median(estimate)),
                         "pilot_estimate_quartiles": [float(q) for q in np.percentile(estimate, [25, 75])],
                         "first_decided_median": float(np.median(first)),
                         "first_decided_quartiles": [float(q) for q in np.percentile(first, [25, 75])],
                         "decided_by_the_estimate": float(np.mean(first <= estimate))})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sims", type=int, default=20_000, help="simulated comparisons per cell")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "measured" / "verdict_calibration.json")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    result = {"measured": time.strftime("%Y-%m-%d"), "sims_per_cell": args.sims, "alpha": ALPHA,
              "identical_arms": identical_arms(rng, args.sims),
              "secondary_family": secondary_family(rng, args.sims // 4),
              "planted_effect": planted_effect(rng, args.sims),
              "pilot_estimate": pilot_estimate(rng, max(200, args.sims // 20))}
    fp = [r["false_positive_one_sampler"] for r in result["identical_arms"]]
    fam = [r["false_positive_two_samplers_any"] for r in result["identical_arms"]]
    power = [r["decided_right"] for r in result["planted_effect"]]
    held = [r for r in result["identical_arms"] if r["false_positive_one_sampler"] <= ALPHA + 0.015
            and r["false_positive_two_samplers_any"] <= ALPHA + 0.015]
    result["summary"] = {
        "false_positive_range": [min(fp), max(fp)], "family_false_positive_range": [min(fam), max(fam)],
        "decided_right_range": [min(power), max(power)],
        "level_held_where": sorted({(r["tail"], r["spread_ratio"]) for r in held}),
        "level_not_held_where": sorted({(r["tail"], r["spread_ratio"]) for r in result["identical_arms"]
                                        if r not in held}),
        "seconds": round(time.perf_counter() - t0, 1)}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
