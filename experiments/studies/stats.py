"""Statistics of the studies: comparisons of arms at the level of seeds, and CIs over examples.

The unit of replication is the seed (one trained model): two arms differ when their seeds'
accuracies do, not when these particular models disagree on many test examples. The primary
comparison is therefore seed-level: the difference of the arms' seed means with a two-level
bootstrap CI (`seed_bootstrap_diff`: seeds resampled within each arm, or seed pairs, then test
examples), and a test over seeds that fits how the seeds were drawn. A recipe's seed fixes the
initialisation and the data order, so seed k of arm A and seed k of arm B saw the same batches:
such arms are *paired* and are compared by a paired t-test over the per-seed differences
(`paired_t`) and the exact sign-flip test (`sign_flip_test`; with 5 pairs it cannot go below
0.0625). Arms given independent data orders (``config.data_seed``) are compared by a Welch
t-test over the per-seed accuracies (`welch_t`) and an exact permutation test over seeds
(`permutation_test`). `gap_change` (or `paired_gap_change`) tests whether a gap between two arms
changes between two conditions (a difference of differences); `seeds_for_power` says how many
seeds a difference of the measured size would need, and `holm` adjusts the p-values of a
family of comparisons (one claim over several evaluations or arms) so that the chance of any
false rejection stays at alpha.

The LieRE paper reports 95 % CIs from B = 1000 bootstrap resamples of the test examples, and a
paired z-test for its initialisation table; `bootstrap_ci` and `paired_z` are those
computations on our per-example results (``eval_examples.npz`` of each run: whether each test
example was classified right). They describe *these trained models on this test set*: their
standard errors ignore the variance between seeds, so `paired_z` rejects even between two seeds
of one arm (the placebo test in tests/test_studies.py) and must not be read as a comparison of
encodings.
"""

from __future__ import annotations

import itertools
import math
from statistics import NormalDist

import numpy as np

B = 1000  # bootstrap resamples, as the LieRE paper
ALPHA = 0.05  # two-sided: 95 % intervals


def bootstrap_ci(
    correct_SN: np.ndarray, *, num_resamples: int = B, alpha: float = ALPHA, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap CI of the seed-mean accuracy, resampling test examples.

    Args:
      correct_SN: bool or 0/1 (S, N): seed s classified example n right. All seeds are scored
        on the same N examples, so one resample of the examples is applied to every seed.
      num_resamples: B.
      alpha: 1 - coverage.
      seed: of the resampling (fixed: the same results give the same interval).

    Returns:
      (low, high) of the (1 - alpha) interval of mean over seeds and examples.
    """
    correct_SN = np.atleast_2d(np.asarray(correct_SN, np.float64))
    num = correct_SN.shape[1]
    if num == 0:
        raise ValueError("bootstrap_ci needs at least one example, got shape (S, 0)")
    per_example_N = correct_SN.mean(axis=0)  # seed-mean per example: resampling is per example
    idx_BN = np.random.default_rng(seed).integers(0, num, size=(num_resamples, num))
    means_B = per_example_N[idx_BN].mean(axis=1)
    low, high = np.quantile(means_B, [alpha / 2, 1 - alpha / 2])
    return float(low), float(high)


# A spread or a mean below this, relative to the values' size, is float rounding: a constant
# difference (0.9 - 0.8 three times) must read the same as an exact one (0.5 - 0.4), not come
# out once as t = 1e15, p = 1e-31 and once as NaN.
_ROUNDING = 1e-12


def _negligible(x: float, values) -> bool:
    """``x`` is within float rounding of 0 for quantities of the size of ``values``."""
    return abs(x) <= _ROUNDING * max(1.0, float(np.max(np.abs(values))))


def paired_z(correct_a_SN: np.ndarray, correct_b_SN: np.ndarray) -> dict[str, float]:
    """Paired z-test of accuracy(a) - accuracy(b) on the same test examples: do *these trained
    models* differ on *this test set*? Not a comparison of encodings (seed variance is ignored;
    use `welch_t` / `permutation_test` for that).

    The per-example difference d_n = mean_s a_sn - mean_s b_sn (seeds averaged, examples
    paired) has mean D and standard error sd(d) / sqrt(N); z = D / se, two-sided normal p, and
    the normal 95 % CI D +- 1.96 se (the LieRE paper's Table 7 reports D, z, p and this CI).

    Returns:
      {"diff", "se", "z", "p", "ci_low", "ci_high", "num_examples"}.
    """
    a = np.atleast_2d(np.asarray(correct_a_SN, np.float64)).mean(axis=0)
    b = np.atleast_2d(np.asarray(correct_b_SN, np.float64)).mean(axis=0)
    if a.shape != b.shape:
        raise ValueError(f"paired_z needs the same examples on both sides: {a.shape} vs {b.shape}")
    d = a - b
    diff = float(d.mean())
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else 0.0
    if _negligible(se, d):
        se = 0.0
        z = 0.0 if _negligible(diff, d) else math.copysign(math.inf, diff)
    else:
        z = diff / se
    p = math.erfc(abs(z) / math.sqrt(2.0))
    half = 1.959963984540054 * se
    return dict(
        diff=diff, se=se, z=z, p=p, ci_low=diff - half, ci_high=diff + half, num_examples=len(d)
    )


# --------------------------------------------------------------------------- seed level


def seed_accuracies(correct_SN: np.ndarray) -> np.ndarray:
    """float (S,) each seed's accuracy from its per-example results (S, N)."""
    correct_SN = np.atleast_2d(np.asarray(correct_SN, np.float64))
    if correct_SN.shape[1] == 0:
        raise ValueError("seed_accuracies needs at least one example, got shape (S, 0)")
    return correct_SN.mean(axis=1)


def seed_bootstrap_diff(
    correct_a_SN: np.ndarray,
    correct_b_SN: np.ndarray,
    *,
    num_resamples: int = B,
    alpha: float = ALPHA,
    seed: int = 0,
    paired: bool = False,
) -> dict[str, float]:
    """Difference of the arms' seed-mean accuracies, a - b, with a two-level bootstrap CI.

    Each resample draws the seeds of each arm with replacement (S_a from arm a's S_a, S_b from
    arm b's; with `paired`, one draw of seed indices for both arms, whose rows are the pairs),
    then the test examples with replacement; both arms are scored on the same test
    set, so one resample of the examples serves every seed of both arms (the pairing of the
    test set is kept). The interval is the percentile interval of the resampled differences.
    With 3 seeds an arm's resampled mean takes few values and the bootstrap variance is
    (S - 1) / S of the plug-in one: the interval is indicative, the seed-level tests decide.

    Args:
      correct_a_SN, correct_b_SN: bool or 0/1 (S_a, N), (S_b, N): per-example results of the
        two arms' seeds on the same N test examples.
      num_resamples: B.
      alpha: 1 - coverage.
      seed: of the resampling (fixed: the same results give the same interval).
      paired: row s of both arms is one pair (the same data order): resample pairs.

    Returns:
      {"diff", "ci_low", "ci_high", "seeds_a", "seeds_b"}.
    """
    a_SN = np.atleast_2d(np.asarray(correct_a_SN, np.float64))
    b_SN = np.atleast_2d(np.asarray(correct_b_SN, np.float64))
    if a_SN.shape[1] != b_SN.shape[1] or a_SN.shape[1] == 0:
        raise ValueError(
            f"seed_bootstrap_diff needs the same non-empty test set on both sides: examples "
            f"{a_SN.shape[1]} vs {b_SN.shape[1]}"
        )
    if paired and len(a_SN) != len(b_SN):
        raise ValueError(f"paired seeds need as many in each arm, got {len(a_SN)} and {len(b_SN)}")
    num = a_SN.shape[1]
    rng = np.random.default_rng(seed)
    # Example weights of each resample (counts / N): accuracy of seed s = correct_sN @ w_N.
    weights_BN = rng.multinomial(num, np.full(num, 1.0 / num), size=num_resamples) / num
    means = []
    pick_BS = None
    for x_SN in (a_SN, b_SN):
        acc_BS = weights_BN @ x_SN.T
        if pick_BS is None or not paired:
            pick_BS = rng.integers(0, x_SN.shape[0], size=acc_BS.shape)
        means.append(np.take_along_axis(acc_BS, pick_BS, axis=1).mean(axis=1))
    diffs_B = means[0] - means[1]
    low, high = np.quantile(diffs_B, [alpha / 2, 1 - alpha / 2])
    diff = float(a_SN.mean() - b_SN.mean())
    return dict(
        diff=diff, ci_low=float(low), ci_high=float(high), seeds_a=len(a_SN), seeds_b=len(b_SN)
    )


def welch_t(acc_a_S: np.ndarray, acc_b_S: np.ndarray) -> dict[str, float]:
    """Welch's t-test of mean(a) - mean(b) over per-seed accuracies (unequal variances).

    With both arms' seeds identical within each arm (zero variance, e.g. all at 100 %), t is
    undefined: p = 1 when the means are equal, NaN otherwise.

    Args:
      acc_a_S, acc_b_S: float (S_a,), (S_b,) per-seed accuracies, at least 2 seeds each.

    Returns:
      {"diff", "t", "df", "p"} (two-sided p).
    """
    a, b = np.asarray(acc_a_S, np.float64), np.asarray(acc_b_S, np.float64)
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"welch_t needs at least 2 seeds per arm, got {len(a)} and {len(b)}")
    diff = float(a.mean() - b.mean())
    return dict(diff=diff, **_satterthwaite_t(diff, [a, b]))


def paired_t(acc_a_S: np.ndarray, acc_b_S: np.ndarray) -> dict[str, float]:
    """Paired t-test of mean(a - b) over seed pairs (row s of both arms saw the same data).

    With no spread in the differences, t is undefined: p = 1 when they are all 0, NaN
    otherwise (as `welch_t`).

    Args:
      acc_a_S, acc_b_S: float (S,), (S,) per-seed accuracies, pair s = seed s of each arm; at
        least 2 pairs.

    Returns:
      {"diff", "t", "df", "p"} (two-sided p, df = S - 1).
    """
    from scipy import stats as scipy_stats

    d = _pair_differences(acc_a_S, acc_b_S, "paired_t")
    diff = float(d.mean())
    se = float(d.std(ddof=1) / math.sqrt(len(d)))
    if _negligible(se, d):
        nan, zero = float("nan"), _negligible(diff, d)
        return dict(diff=diff, t=0.0 if zero else nan, df=float(len(d) - 1), p=1.0 if zero else nan)
    t = diff / se
    df = len(d) - 1
    return dict(diff=diff, t=float(t), df=float(df), p=float(2 * scipy_stats.t.sf(abs(t), df)))


def _pair_differences(acc_a_S, acc_b_S, name: str, minimum: int = 2) -> np.ndarray:
    a, b = np.asarray(acc_a_S, np.float64), np.asarray(acc_b_S, np.float64)
    if a.shape != b.shape or a.ndim != 1 or len(a) < minimum:
        raise ValueError(
            f"{name} needs {minimum} or more seed pairs (as many seeds in each arm), got "
            f"{len(a)} and {len(b)}"
        )
    return a - b


MAX_EXACT_FLIPS = 2**17  # beyond this many sign vectors, a Monte Carlo sign-flip test


def sign_flip_test(
    acc_a_S: np.ndarray, acc_b_S: np.ndarray, *, num_random: int = 100_000, seed: int = 0
) -> dict[str, float]:
    """Exact sign-flip (paired permutation) test of mean(a - b) over seed pairs, two-sided.

    Under the null the two arms of a pair are exchangeable, so each pair's difference is as
    likely with either sign: p is the share of the 2^S sign vectors whose |mean of the signed
    differences| reaches the observed one (every vector up to `MAX_EXACT_FLIPS`, beyond that
    `num_random` random ones, the observed one counted in). The observed vector and its mirror
    always count: with 5 pairs p >= 2 / 32 = 0.0625, with 3 pairs p >= 0.25.

    Returns:
      {"diff", "p", "min_p", "exact"}.
    """
    d = _pair_differences(acc_a_S, acc_b_S, "sign_flip_test", minimum=1)
    n = len(d)
    observed = abs(d.mean())
    exact = 2**n <= MAX_EXACT_FLIPS
    if exact:
        signs_PN = 1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)[None]) & 1)
    else:
        signs_PN = np.where(np.random.default_rng(seed).random((num_random, n)) < 0.5, -1, 1)
    hits = int(np.sum(np.abs(signs_PN @ d / n) >= observed - 1e-12))
    if exact:
        p, min_p = hits / 2**n, 2 / 2**n
    else:
        p, min_p = (hits + 1) / (num_random + 1), 1 / (num_random + 1)
    return dict(diff=float(d.mean()), p=float(p), min_p=float(min(min_p, 1.0)), exact=exact)


def paired_gap_change(
    acc_a_S: np.ndarray, acc_b_S: np.ndarray, acc_c_S: np.ndarray, acc_d_S: np.ndarray
) -> dict[str, float]:
    """`gap_change` for four arms whose seed s saw one data order: per seed, the difference of
    differences (a_s - b_s) - (c_s - d_s), tested by a one-sample t over the seeds (df S - 1)
    and the exact sign-flip test (``p_flip``).

    Returns:
      {"diff", "gap_ab", "gap_cd", "t", "df", "p", "p_flip", "p_flip_min"}.
    """
    arms = [np.asarray(x, np.float64) for x in (acc_a_S, acc_b_S, acc_c_S, acc_d_S)]
    if len({len(x) for x in arms}) != 1 or len(arms[0]) < 2:
        raise ValueError(
            f"paired_gap_change needs 2 or more seeds, as many in each arm, got "
            f"{[len(x) for x in arms]}"
        )
    a, b, c, d = arms
    gaps = (a - b) - (c - d)
    test = paired_t(gaps, np.zeros_like(gaps))
    flip = sign_flip_test(gaps, np.zeros_like(gaps))
    return dict(
        diff=test["diff"],
        gap_ab=float((a - b).mean()),
        gap_cd=float((c - d).mean()),
        t=test["t"],
        df=test["df"],
        p=test["p"],
        p_flip=flip["p"],
        p_flip_min=flip["min_p"],
    )


def _satterthwaite_t(diff: float, arms: list[np.ndarray]) -> dict[str, float]:
    """t, Welch-Satterthwaite df and two-sided p of `diff`, a signed sum of the arms' seed
    means (independent seeds, unequal variances). No spread in any arm: t is undefined, p = 1
    when diff = 0, NaN otherwise."""
    from scipy import stats as scipy_stats

    v = [x.var(ddof=1) / len(x) for x in arms]
    se2 = sum(v)
    values = np.concatenate(arms)
    if _negligible(math.sqrt(se2), values):
        nan, zero = float("nan"), _negligible(diff, values)
        return dict(t=0.0 if zero else nan, df=nan, p=1.0 if zero else nan)
    t = diff / math.sqrt(se2)
    df = se2**2 / sum(vi**2 / (len(x) - 1) for vi, x in zip(v, arms, strict=True))
    return dict(t=float(t), df=float(df), p=float(2 * scipy_stats.t.sf(abs(t), df)))


def gap_change(
    acc_a_S: np.ndarray, acc_b_S: np.ndarray, acc_c_S: np.ndarray, acc_d_S: np.ndarray
) -> dict[str, float]:
    """Welch-type t-test of whether a gap changes between two conditions: (a - b) - (c - d).

    The four arms' seeds are independent (e.g. LieRE and APE at 10 % of the data, and LieRE
    and APE at 100 %): the difference of differences of the seed means has the variance
    sum_i s_i^2 / n_i, and its degrees of freedom follow Welch-Satterthwaite. This is the test
    of a claim such as "the gap to APE grows as the data shrink"; two separate comparisons (one
    resolved, one not) do not show that the gaps differ.

    Args:
      acc_a_S, acc_b_S, acc_c_S, acc_d_S: float per-seed accuracies, at least 2 seeds each.

    Returns:
      {"diff", "gap_ab", "gap_cd", "t", "df", "p"} (two-sided p; t, df and p as `welch_t`'s
      when no arm has spread: p = 1 for no change, NaN otherwise).
    """
    arms = [np.asarray(x, np.float64) for x in (acc_a_S, acc_b_S, acc_c_S, acc_d_S)]
    if min(len(x) for x in arms) < 2:
        raise ValueError(f"gap_change needs at least 2 seeds per arm, got {[len(x) for x in arms]}")
    a, b, c, d = (x.mean() for x in arms)
    gap_ab, gap_cd = float(a - b), float(c - d)
    diff = gap_ab - gap_cd
    return dict(diff=diff, gap_ab=gap_ab, gap_cd=gap_cd, **_satterthwaite_t(diff, arms))


MAX_EXACT_SPLITS = 200_000  # beyond this many seed splits, a Monte Carlo permutation test


def permutation_test(
    acc_a_S: np.ndarray, acc_b_S: np.ndarray, *, num_random: int = 100_000, seed: int = 0
) -> dict[str, float]:
    """Permutation test of mean(a) - mean(b) over per-seed accuracies, two-sided.

    Under the null the arm labels of the seeds are exchangeable: p is the share of the
    C(S_a + S_b, S_a) relabellings whose |difference of means| reaches the observed one
    (exact: every relabelling, up to `MAX_EXACT_SPLITS` of them; beyond, `num_random` random
    ones, the observed one counted in). With 3 seeds per arm there are 20 relabellings and the
    observed one and its mirror always count: p >= 0.1.

    Returns:
      {"diff", "p", "min_p", "exact"}: min_p the smallest p this many seeds can give.
    """
    a, b = np.asarray(acc_a_S, np.float64), np.asarray(acc_b_S, np.float64)
    if len(a) < 1 or len(b) < 1:
        raise ValueError(f"permutation_test needs seeds in both arms, got {len(a)} and {len(b)}")
    pooled = np.concatenate([a, b])
    n, k = len(pooled), len(a)
    observed = abs(a.mean() - b.mean())
    total = math.comb(n, k)
    exact = total <= MAX_EXACT_SPLITS
    if exact:
        in_a_PN = np.zeros((total, n), bool)
        for i, chosen in enumerate(itertools.combinations(range(n), k)):
            in_a_PN[i, list(chosen)] = True
    else:
        rng = np.random.default_rng(seed)
        order_PN = np.argsort(rng.random((num_random, n)), axis=1)
        in_a_PN = np.zeros((num_random, n), bool)
        np.put_along_axis(in_a_PN, order_PN[:, :k], True, axis=1)
    sum_a = in_a_PN @ pooled
    diffs = np.abs(sum_a / k - (pooled.sum() - sum_a) / (n - k))
    hits = int(np.sum(diffs >= observed - 1e-12))
    if exact:
        p, min_p = hits / total, (2 if k == n - k else 1) / total
    else:
        p, min_p = (hits + 1) / (num_random + 1), 1 / (num_random + 1)
    return dict(diff=float(a.mean() - b.mean()), p=float(p), min_p=float(min_p), exact=exact)


def seeds_for_power(
    sd: float,
    diff: float,
    *,
    alpha: float = ALPHA,
    power: float = 0.8,
    small_sample: bool = True,
    paired: bool = False,
) -> float:
    """Seeds per arm for a two-sided two-sample test at level `alpha` to detect `diff` with
    `power`: n = 2 (z_(1 - alpha / 2) + z_power)^2 sd^2 / diff^2 (the normal approximation), at
    least 2. With `small_sample` the z quantiles become Student t quantiles with 2 n - 2
    degrees of freedom and n is the smallest that satisfies the formula: at a few seeds the
    normal formula promises power it does not have (a difference of 3 SDs: 2 seeds by the
    normal formula, 4 with t). inf for diff = 0. With `paired`, seed pairs for the paired
    t-test: n = (z + z)^2 sd^2 / diff^2 with `sd` the SD of the pair differences, t quantiles
    at n - 1 degrees of freedom.

    Args:
      sd: the per-seed standard deviation of accuracy (e.g. `pooled_sd` of the measured seeds),
        or with `paired` that of the per-pair differences.
      diff: the difference of means to detect.
    """
    if sd < 0 or not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"seeds_for_power: sd={sd}, alpha={alpha}, power={power} out of range")
    if diff == 0:
        return math.inf
    arms = 1 if paired else 2  # the variance of the difference: sd^2 (pairs) or 2 sd^2
    ratio = sd**2 / diff**2
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    n = max(2, math.ceil(arms * z**2 * ratio))
    if not small_sample:
        return float(n)
    from scipy import stats as scipy_stats

    while True:  # the t formula's n is at least the normal one: count up from it
        dof = n - 1 if paired else 2 * n - 2
        t = scipy_stats.t.ppf(1 - alpha / 2, dof) + scipy_stats.t.ppf(power, dof)
        if n >= arms * t**2 * ratio:
            return float(n)
        n += 1


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment (Holm, 1979): the k-th smallest of m p-values is multiplied
    by m - k + 1, kept at least as large as the adjusted ones before it, and capped at 1; a
    comparison is rejected at family-wise level alpha when its adjusted p <= alpha. NaN
    p-values (a comparison without two seeds per arm) stay NaN and do not count in m."""
    finite = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    if any(not 0 <= p <= 1 for p, _ in finite):
        raise ValueError(f"holm: p-values must be in [0, 1]; got {list(p_values)}")
    adjusted = [float("nan")] * len(p_values)
    running = 0.0
    for k, (p, i) in enumerate(finite):
        running = max(running, min(1.0, (len(finite) - k) * p))
        adjusted[i] = running
    return adjusted


def pooled_sd(acc_a_S: np.ndarray, acc_b_S: np.ndarray) -> float:
    """Pooled standard deviation of per-seed accuracies over both arms (ddof 1 within each)."""
    a, b = np.asarray(acc_a_S, np.float64), np.asarray(acc_b_S, np.float64)
    dof = len(a) + len(b) - 2
    if dof < 1:
        raise ValueError(f"pooled_sd needs 3 seeds or more in all, got {len(a)} + {len(b)}")
    ss = ((a - a.mean()) ** 2).sum() + ((b - b.mean()) ** 2).sum()
    return float(math.sqrt(ss / dof))


PAIRED, WELCH = "paired t", "Welch"  # compare_arms' "test": which test gave "p"


def compare_arms(
    correct_a_SN: np.ndarray, correct_b_SN: np.ndarray, *, paired: bool = False
) -> dict[str, float]:
    """Every comparison of two arms on one evaluation, seed level first.

    Args:
      correct_a_SN, correct_b_SN: per-example results of the arms' seeds on one test set.
      paired: row s of both arms is one pair (seed s of each, the same data order; as many
        rows in each): the paired t-test and the sign-flip test instead of Welch's and the
        two-sample permutation test, a pair bootstrap, and pairs for 80 % power.

    Returns a dict: ``test`` ("paired t" or "Welch"), ``seeds_a``, ``seeds_b``, ``acc_a``,
    ``acc_b`` (per-seed accuracies), ``diff`` and its two-level bootstrap CI (``ci_low``,
    ``ci_high``), ``p`` (the primary test over seeds, ``test``), ``t``, ``df``, ``p_perm`` /
    ``p_perm_min`` (exact sign-flip over pairs, or permutation over seeds), ``p_welch``
    (Welch on the same seeds, for reference where paired), ``sd`` (the SD of the pair
    differences, or the pooled per-seed SD), ``seeds_needed`` (pairs, or seeds per arm, for 80
    % power at alpha 0.05 at the measured difference), and the example-level paired test of
    these trained models (``z_examples``, ``p_examples``, ``ci_examples``).
    """
    acc_a, acc_b = seed_accuracies(correct_a_SN), seed_accuracies(correct_b_SN)
    boot = seed_bootstrap_diff(correct_a_SN, correct_b_SN, paired=paired)
    enough = len(acc_a) >= 2 and len(acc_b) >= 2
    nan = float("nan")
    welch = welch_t(acc_a, acc_b) if enough else dict(t=nan, df=nan, p=nan)
    if paired:
        test = paired_t(acc_a, acc_b) if enough else dict(t=nan, df=nan, p=nan)
        perm = sign_flip_test(acc_a, acc_b)
        sd = float(np.std(acc_a - acc_b, ddof=1)) if enough else nan
    else:
        test, perm = welch, permutation_test(acc_a, acc_b)
        sd = pooled_sd(acc_a, acc_b) if len(acc_a) + len(acc_b) >= 3 else nan
    need = seeds_for_power(sd, boot["diff"], paired=paired) if not math.isnan(sd) else nan
    examples = paired_z(correct_a_SN, correct_b_SN)  # seed means per example: any seed counts
    return dict(
        test=PAIRED if paired else WELCH,
        seeds_a=len(acc_a),
        seeds_b=len(acc_b),
        acc_a=acc_a,
        acc_b=acc_b,
        diff=boot["diff"],
        ci_low=boot["ci_low"],
        ci_high=boot["ci_high"],
        p=test["p"],
        t=test["t"],
        df=test["df"],
        p_perm=perm["p"],
        p_perm_min=perm["min_p"],
        p_welch=welch["p"],
        sd=sd,
        seeds_needed=need,
        z_examples=examples["z"],
        p_examples=examples["p"],
        ci_examples=(examples["ci_low"], examples["ci_high"]),
    )


# E[max_d count_d] / 8 for the 8 arrows of a layout (7 distractors with random directions plus
# the target, whose direction is the label): what a model that sees which glyphs are present
# but not where can reach by answering the majority direction. Computed by `blind_ceiling`.
def blind_ceiling(num_arrows: int = 8, num_directions: int = 4, samples: int = 200_000) -> float:
    """Accuracy of the best position-blind guess on the arrows task (majority direction).

    With ties broken at random, the majority guess is right with probability
    E[max_d c_d / num_arrows] over the multinomial direction counts c.
    """
    rng = np.random.default_rng(0)
    counts = rng.multinomial(num_arrows, [1 / num_directions] * num_directions, size=samples)
    return float((counts.max(axis=1) / num_arrows).mean())


def distance_only_ceiling(glyphs_NG: np.ndarray, y_cell_NA: np.ndarray, num_dirs: int = 4):
    """Per-example best accuracy of a model that sees the glyphs and their pairwise distances
    but no directions (2D ALiBi: a bias of the Euclidean distance alone, nothing else
    positional), on 2D arrows layouts.

    Such a model is invariant to the 8 symmetries of the square grid that move the glyphs
    without turning them. They take the Y's stem neighbour (the target) to each of the Y's
    four neighbours, and every one of those layouts is as likely as the real one when that
    neighbour holds an arrow. So the best answer is the majority direction among the arrows
    next to the Y (the target is any of them with equal probability), right with probability
    (count of the majority direction) / (number of arrows next to the Y).

    Args:
      glyphs_NG: int (N, G, G) glyph ids, arrows 0..num_dirs-1, -1 empty (``sample_layouts``).
      y_cell_NA: int (N, 2) the Y's cell.
      num_dirs: arrow directions (4 in 2D).

    Returns:
      float (N,) the expected accuracy of the best distance-only answer on each example.
    """
    n, g = glyphs_NG.shape[0], glyphs_NG.shape[1]
    counts_ND = np.zeros((n, num_dirs))
    for dr, dc in ((-1, 0), (0, 1), (1, 0), (0, -1)):
        r, c = y_cell_NA[:, 0] + dr, y_cell_NA[:, 1] + dc
        inside = (r >= 0) & (r < g) & (c >= 0) & (c < g)
        ids = np.where(inside, glyphs_NG[np.arange(n), r.clip(0, g - 1), c.clip(0, g - 1)], -1)
        is_arrow = (ids >= 0) & (ids < num_dirs)
        counts_ND[np.arange(n)[is_arrow], ids[is_arrow]] += 1
    return counts_ND.max(axis=1) / counts_ND.sum(axis=1)  # the target is one: never 0 / 0


def arrows_distance_only_ceiling(config_name: str, split: str = "test") -> float:
    """`distance_only_ceiling` averaged over a ``spatial_arrows`` split, regenerated from its
    seed (the same layouts as the TFDS dataset): 0.903 / 0.945 / 0.970 / 0.980 on the test
    splits of c8_g8 / c8_g12 / c8_g16 / c8_g20 (the grids get sparser, fewer neighbours)."""
    from rope_lie.data import spatial_arrows

    config = {c.name: c for c in spatial_arrows.CONFIGS}[config_name]
    total = config.num_test if split == "test" else config.num_train
    per_example = []
    for chunk in range(-(-total // spatial_arrows.CHUNK)):
        layout = spatial_arrows.generate_chunk(config, split, chunk)
        per_example.append(distance_only_ceiling(layout["glyphs"], layout["y_cell"]))
    return float(np.concatenate(per_example)[:total].mean())
