"""``experiments/studies/plateau.py``: issue 48's rule (the epochs after which doubling adds
less than 0.3 points), the arms it trains next, and its section of the study's summary."""

from __future__ import annotations

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


def test_seeds_are_averaged_and_a_gap_in_the_ladder_stops_the_reading():
    rows = _rows({APE: [0.87, 0.88]}, seed=0) + _rows({APE: [0.87, 0.8854]}, seed=1)
    assert plateau.verdict(STUDY, rows)["plateaus"][APE] is None  # +0.77 on the mean
    rows = [r for r in _rows({APE: [0.87, 0.88, 0.89]}) if r["arm"] != NAMES[APE][1]]
    assert plateau.arm_plateau(plateau.ladders(STUDY, rows)[APE]) is None
    assert plateau.next_arms(plateau.ladders(STUDY, rows)[APE]) == [NAMES[APE][1]]


def test_a_ladder_that_is_not_doublings_is_refused():
    ladder = [(10.0, "a", 0.8), (30.0, "b", 0.8)]
    with pytest.raises(ValueError, match="rungs 10.0 and 30.0: the rule compares doublings"):
        plateau.arm_plateau(ladder)


def test_the_summary_reads_the_rule_on_the_committed_results(tmp_path):
    rows = lib.read_results(run.study_dir(plateau.STUDY, None))
    text = "\n".join(plateau.markdown(STUDY, rows))
    assert "| 20 | 89.19 % (+1.72) | 89.22 % (+2.15) |" in text  # the first two committed rungs
    result = plateau.verdict(STUDY, rows)
    for label, value in result["plateaus"].items():
        said = f"{label}: plateau at {value:g} epochs" if value else f"{label}: not reached by"
        assert said in text


def test_the_plot_draws_each_line_s_measured_rungs(tmp_path):
    rows = _rows({APE: [0.87, 0.89, 0.911], LIERE: [0.87]})
    path = plateau.plot(STUDY, rows, str(tmp_path / "plateau.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
