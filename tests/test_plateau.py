"""``experiments/studies/plateau.py``: issue 48's rule (the epochs after which doubling adds
less than 0.3 points), the arms it trains next, and its section of the study's summary."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.studies import lib, plateau, run
from experiments.studies.definitions import STUDIES

STUDY = STUDIES[plateau.STUDY]
NAMES = {label: [name for _, name in line] for label, line in STUDY.curves[1]}
APE, LIERE = NAMES  # the two lines, in the study's order


def _rows(accuracies: dict[str, list[float]], seed: int = 0) -> list[dict]:
    """results.csv rows: each line's test accuracy at 10, 20, 40, ... epochs, in order."""
    return [
        {"arm": name, "seed": seed, "eval": "test", "accuracy": acc}
        for label, values in accuracies.items()
        for name, acc in zip(NAMES[label], values, strict=False)
    ]


def test_an_arm_plateaus_at_the_first_doubling_that_adds_under_a_third_of_a_point():
    rows = _rows({APE: [0.87, 0.89, 0.911, 0.9139], LIERE: [0.87, 0.89, 0.91, 0.912, 0.9135]})
    result = plateau.verdict(STUDY, rows)
    assert result["plateaus"] == {APE: 40.0, LIERE: 40.0}  # +0.29 and +0.20 after 40
    assert result["plateau"] == 40.0 and result["next"] == []


def test_the_recipes_plateau_waits_for_every_arm_and_the_longest_wins():
    rows = _rows({APE: [0.87, 0.872], LIERE: [0.85, 0.87, 0.89]})
    result = plateau.verdict(STUDY, rows)
    assert result["plateaus"] == {APE: 10.0, LIERE: None}
    assert result["plateau"] is None and result["next"] == [NAMES[LIERE][3]]
    rows += _rows({LIERE: [0.85, 0.87, 0.89, 0.891]})[3:]
    assert plateau.verdict(STUDY, rows)["plateau"] == 40.0


def test_the_shorter_rung_is_trained_first_whichever_line_it_is_on():
    rows = _rows({APE: [0.85, 0.87, 0.89, 0.91], LIERE: [0.85, 0.87]})
    assert plateau.verdict(STUDY, rows)["next"] == [NAMES[LIERE][2], NAMES[APE][4]]


def test_seeds_are_averaged_and_a_gap_in_the_ladder_stops_the_reading():
    rows = _rows({APE: [0.87, 0.88]}, seed=0) + _rows({APE: [0.87, 0.8854]}, seed=1)
    assert plateau.verdict(STUDY, rows)["plateaus"][APE] is None  # +0.77 on the mean
    rows = [r for r in _rows({APE: [0.87, 0.88, 0.89]}) if r["arm"] != NAMES[APE][1]]
    assert plateau.arm_plateau(plateau.ladders(STUDY, rows)[APE]) is None
    assert plateau.next_arms(plateau.ladders(STUDY, rows)[APE]) == [NAMES[APE][1]]


def test_a_gain_of_exactly_a_third_of_a_point_is_not_a_plateau():
    """0.9259 - 0.9229 is 0.0029999... in floating point: the rule says "less than 0.3"."""
    rows = _rows({APE: [0.9229, 0.9259, 0.9288]})
    assert plateau.verdict(STUDY, rows)["plateaus"][APE] == 20.0


@pytest.mark.parametrize(
    "extra, match",
    [
        (_rows({APE: [0.87, 0.89]}, seed=1)[1:], r"rungs hold different seeds"),  # 20 only
        (_rows({APE: [0.95]}), r"seed 0: two 'test' rows"),  # a rerun recorded twice
        (None, r"seed 0: test accuracy nan, not a number"),
    ],
)
def test_rungs_over_other_seeds_a_rerun_or_a_nan_are_refused(extra, match):
    """A gain of seed means over other seeds (seed 1 at 20 epochs, not at 10) or over a rerun
    would be another quantity than the one the rule and its paired error describe."""
    rows = _rows({APE: [0.87, 0.89, 0.91]})
    if extra is None:
        rows[1]["accuracy"] = float("nan")
    else:
        rows += extra
    with pytest.raises(ValueError, match=match):
        plateau.verdict(STUDY, rows)


def test_a_ladder_that_is_not_doublings_is_refused():
    ladder = [(10.0, "a", 0.8), (30.0, "b", 0.8)]
    with pytest.raises(ValueError, match="rungs 10.0 and 30.0: the rule compares doublings"):
        plateau.arm_plateau(ladder)


def _examples(label: str, correct: list[np.ndarray], seed: int = 0) -> dict[str, np.ndarray]:
    """examples.npz's per-image results of a line's rungs 10, 20, 40, ... for one seed."""
    return {f"{name}/{seed}/test": c for name, c in zip(NAMES[label], correct, strict=False)}


def test_each_doubling_s_error_is_paired_over_the_test_images():
    n, gained, lost = 1000, 30, 10
    before = np.arange(n) < 800
    after = before.copy()
    after[800 : 800 + gained] = True
    after[:lost] = False
    errors = plateau.doubling_errors(STUDY, _examples(APE, [before, after]))
    # the paired difference takes +1 on `gained` images, -1 on `lost`, 0 on the rest
    mean = (gained - lost) / n
    se = np.sqrt((gained + lost - n * mean**2) / (n - 1) / n)
    assert errors == {APE: {20.0: pytest.approx(se)}, LIERE: {}}
    # far below two independent runs' binomial errors: the images both get right add nothing
    assert se < 0.5 * np.hypot(*(np.sqrt(p * (1 - p) / n) for p in (0.8, 0.82)))


def test_a_doubling_s_error_averages_its_seeds_per_image_and_needs_both_rungs():
    rng = np.random.default_rng(0)
    c = rng.random((2, 3, 500)) < 0.8  # seed, rung, image
    examples = {**_examples(APE, list(c[0]), seed=0), **_examples(APE, list(c[1]), seed=1)}
    del examples[f"{NAMES[APE][2]}/1/test"]  # rung 40 of seed 1 has no per-image results
    errors = plateau.doubling_errors(STUDY, examples)[APE]
    d = c[:, 1].mean(0) - c[:, 0].mean(0)
    assert errors[20.0] == pytest.approx(d.std(ddof=1) / np.sqrt(500))
    d40 = c[0, 2].astype(float) - c[0, 1]  # seed 0 only: the seeds with both rungs
    assert errors[40.0] == pytest.approx(d40.std(ddof=1) / np.sqrt(500))
    assert 80.0 not in errors


def test_the_summary_gives_each_gain_its_error_and_its_distance_from_the_threshold():
    before = np.arange(1000) < 870
    after = before.copy()
    after[870:880] = True  # +1.00 points
    rows = _rows({APE: [0.87, 0.88]})
    text = "\n".join(plateau.markdown(STUDY, rows, _examples(APE, [before, after])))
    se = np.sqrt((10 - 1000 * 0.01**2) / 999 / 1000)
    assert f"| 20 | 88.00 % (+1.00 ± {100 * se:.2f}) |" in text
    assert f"its doubling to 20 added +1.00 points, {(0.01 - 0.003) / se:+.1f} standard" in text
    assert "| 20 | 88.00 % (+1.00) |" in "\n".join(plateau.markdown(STUDY, rows))  # no images


def test_the_summary_reads_the_rule_on_the_committed_results(tmp_path):
    directory = run.study_dir(plateau.STUDY, None)
    rows, examples = lib.read_results(directory), lib.read_examples(directory)
    text = "\n".join(plateau.markdown(STUDY, rows, examples))
    assert "| 20 | 89.19 % (+1.72 ± 0.22) | 89.22 % (+2.15 ± 0.25) |" in text  # the first rungs
    result = plateau.verdict(STUDY, rows)
    for label, value in result["plateaus"].items():
        said = f"{label}: plateau at {value:g} epochs" if value else f"{label}: not reached by"
        assert said in text


def test_the_plot_draws_each_line_s_measured_rungs(tmp_path):
    rows = _rows({APE: [0.87, 0.89, 0.911], LIERE: [0.87]})
    path = plateau.plot(STUDY, rows, str(tmp_path / "plateau.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
