"""experiments.studies.steps_to: steps to an accuracy on held-out curves, on synthetic curves
whose crossing steps are known."""

import math

import numpy as np
import pytest

from experiments.studies import curves_csv, steps_to

EVAL_STEPS = np.arange(468, 9361, 468)  # one evaluation an epoch, 20 epochs of 468 steps


def _curve(tau: float, top: float = 0.9) -> np.ndarray:
    """A held-out curve top (1 - exp(-step / tau)) at EVAL_STEPS."""
    return top * (1 - np.exp(-EVAL_STEPS / tau))


def _crossing(tau: float, threshold: float, top: float = 0.9) -> float:
    return -tau * math.log(1 - threshold / top)


def test_steps_to_accuracy_interpolates_between_evaluations():
    steps, acc = np.array([100, 200, 300]), np.array([0.5, 0.7, 0.9])
    assert steps_to.steps_to_accuracy(steps, acc, 0.8) == pytest.approx(250)
    assert steps_to.steps_to_accuracy(steps, acc, 0.7) == 200  # reached at an evaluation
    assert steps_to.steps_to_accuracy(steps, acc, 0.4) == 100  # above from the first one
    assert math.isinf(steps_to.steps_to_accuracy(steps, acc, 0.95))
    # a dip below after reaching it does not matter: the first crossing counts
    assert steps_to.steps_to_accuracy(steps, np.array([0.5, 0.85, 0.8]), 0.8) == pytest.approx(
        185.71, abs=0.01
    )
    with pytest.raises(ValueError, match="steps must increase"):
        steps_to.steps_to_accuracy(np.array([2, 1]), np.array([0.1, 0.2]), 0.1)
    # On a smooth curve sampled once an epoch, the interpolated crossing is close to the true
    # one (linear interpolation under a concave curve: a little late).
    found = steps_to.steps_to_accuracy(EVAL_STEPS, _curve(2000.0), 0.85)
    assert found == pytest.approx(_crossing(2000.0, 0.85), rel=0.03)


def _rows(taus: dict[str, list[float]], top: dict[str, float] | None = None) -> list[dict]:
    rows = []
    for arm, per_seed in taus.items():
        for seed, tau in enumerate(per_seed):
            acc = _curve(tau, (top or {}).get(arm, 0.9))
            rows += [
                dict(arm=arm, seed=seed, step=int(s), eval="test", accuracy=float(a))
                for s, a in zip(EVAL_STEPS, acc, strict=True)
            ]
    return rows


def test_a_3_5x_faster_arm_is_found_over_seed_pairs():
    """LieRE's Appendix D, synthetic: arm a's curves rise 3.5x faster than b's, with a seed
    spread of 10 % in both: the geometric-mean ratio is ~3.5 and the paired test over 5 pairs
    resolves it (the sign-flip test at its floor, 0.0625)."""
    rng = np.random.default_rng(0)
    tau_b = 3000 * np.exp(rng.normal(0, 0.1, 5))
    tau_a = tau_b / 3.5 * np.exp(rng.normal(0, 0.1, 5))
    curves_rows = _rows({"liere": list(tau_a), "ape": list(tau_b)})
    steps_a = {
        s: steps_to.steps_to_accuracy(*c, 0.8)
        for s, c in steps_to.curves(curves_rows, "liere", "test").items()
    }
    steps_b = {
        s: steps_to.steps_to_accuracy(*c, 0.8)
        for s, c in steps_to.curves(curves_rows, "ape", "test").items()
    }
    result = steps_to.compare_steps(steps_a, steps_b, paired=True)
    true = np.exp(np.mean(np.log(tau_b) - np.log(tau_a)))
    assert result["ratio"] == pytest.approx(true, rel=0.08)
    assert result["p"] < 0.01 and result["p_perm"] == pytest.approx(0.0625)
    assert result["used"] == 5 and result["unreached_a"] == result["unreached_b"] == 0


def test_equal_arms_are_not_told_apart_at_more_than_the_nominal_rate():
    """Two arms of one curve distribution (seed spread 15 %): the paired test on the log
    ratio rejects at about 5 %, independent seeds by Welch too."""
    rng = np.random.default_rng(1)
    reps, paired, welch = 300, 0, 0
    for _ in range(reps):
        taus = {arm: list(3000 * np.exp(rng.normal(0, 0.15, 5))) for arm in ("a", "b")}
        rows = _rows(taus)
        steps = {
            arm: {
                s: steps_to.steps_to_accuracy(*c, 0.8)
                for s, c in steps_to.curves(rows, arm, "test").items()
            }
            for arm in taus
        }
        paired += steps_to.compare_steps(steps["a"], steps["b"], paired=True)["p"] < 0.05
        welch += steps_to.compare_steps(steps["a"], steps["b"], paired=False)["p"] < 0.05
    slack = 2 * np.sqrt(0.05 * 0.95 / reps)
    assert paired / reps <= 0.05 + slack and welch / reps <= 0.05 + slack


def test_the_cli_reads_held_out_csv_and_counts_seeds_that_never_reach(tmp_path, capsys):
    """An arm whose curve tops out at 84 % never reaches 85 %: reported, left out of the
    ratio; 'final' is b's mean final accuracy."""
    rows = _rows({"a": [1000.0, 1100.0, 900.0], "b": [3000.0, 3300.0, 2700.0]}, top={"a": 0.9})
    rows += _rows({"c": [1000.0, 1000.0, 1000.0]}, top={"c": 0.84})
    (tmp_path / "toy").mkdir()
    curves_csv.write_csv(rows, str(tmp_path / "toy" / "held_out.csv"), curves_csv.HELD_OUT_COLUMNS)
    steps_to.main(["toy", "a", "b", "--threshold", "0.8,final", f"--results={tmp_path}"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert "as pairs" in lines[0]  # a study the definitions do not know: the seed's data order
    final_b = np.mean([_curve(t)[-1] for t in (3000.0, 3300.0, 2700.0)])
    assert f"| {100 * final_b:.2f} % (b's final mean) |" in lines[-2]
    ratio_row = lines[-3].split(" | ")
    assert float(ratio_row[3]) == pytest.approx(3.0, rel=0.05)
    steps_to.main(["toy", "c", "b", "--threshold", "0.85", f"--results={tmp_path}"])
    out = capsys.readouterr().out
    assert "| 85.00 % | not reached, not reached, not reached |" in out
    assert out.strip().splitlines()[-1] == "p=nan"
    with pytest.raises(SystemExit, match="held_out.csv not found"):
        steps_to.main(["other", "a", "b", f"--results={tmp_path}"])


@pytest.mark.parametrize("paired, p_rank", [(True, 2 / 32), (False, 2 / 252)])
def test_seeds_that_never_reach_count_as_the_slowest_in_the_rank_test(paired, p_rank):
    """b's two slowest seeds never reach the threshold. The ratio and the t test see only the
    three that did (a 2.4x ratio over 3 of 5 pairs); the rank test keeps all five, b slower
    in each: the sign-flip test of 5 positive signed ranks (2 of 32 sign vectors), or the
    permutation test of 5 ranks above 5 (2 of C(10, 5) = 252 relabellings)."""
    steps_a = {s: 400.0 for s in range(5)}
    steps_b = {0: math.inf, 1: math.inf, 2: 1000.0, 3: 957.0, 4: 918.0}
    result = steps_to.compare_steps(steps_a, steps_b, paired=paired)
    assert result["unreached_b"] == 2 and result["ratio"] == pytest.approx(2.4, rel=0.03)
    assert result["p_rank"] == pytest.approx(p_rank)
    # the reverse comparison reads the same
    assert steps_to.compare_steps(steps_b, steps_a, paired=paired)["p_rank"] == pytest.approx(
        p_rank
    )


def test_the_table_says_over_how_many_pairs_its_ratio_is(tmp_path, capsys):
    """b's seed 3 tops out at 70 % and never reaches 80 %."""
    rows = _rows({"a": [1000.0] * 4, "b": [3000.0, 3300.0, 2700.0]})
    rows += _rows({"b": [1.0, 1.0, 1.0, 3000.0]}, top={"b": 0.7})[-len(EVAL_STEPS) :]
    (tmp_path / "toy").mkdir()
    curves_csv.write_csv(rows, str(tmp_path / "toy" / "held_out.csv"), curves_csv.HELD_OUT_COLUMNS)
    steps_to.main(["toy", "a", "b", "--threshold", "0.8", f"--results={tmp_path}"])
    row = capsys.readouterr().out.strip().splitlines()[-2]
    assert "not reached |" in row and "(over 3 of 4 pairs)" in row
    assert row.endswith(f"| {2 / 16:.2g} |")  # four positive signed ranks: 2 of 16 vectors
