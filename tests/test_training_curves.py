"""experiments.studies.training_curves: collected from run workdirs, round-tripped through
training.csv, drawn."""

import json
import os

import numpy as np
import pytest

from experiments.studies import curves_csv, lib, report, training_curves

STUDY = lib.Study(
    name="toy",
    title="toy",
    arms=(lib.Arm("a", "arm A", "digits", "pe=liere"), lib.Arm("b", "arm B", "digits", "pe=ape")),
    evals=("size8",),
)


def _fake_run(root, arm, seed, finished=True):
    workdir = lib.run_dir(root, arm, seed, "cpu")
    os.makedirs(workdir)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        for step in (10, 20, 30):
            line = dict(step=step, epoch=step / 30, loss=1.0 / step, train_accuracy=step / 40.0)
            f.write(json.dumps(line) + "\n")
        f.write(json.dumps({"step": 30, "size8/accuracy": 0.5}) + "\n")  # an eval line
    if finished:
        with open(os.path.join(workdir, "final.json"), "w") as f:
            json.dump({"step": 30, "evals": {}}, f)
        np.savez(os.path.join(workdir, lib.EXAMPLES), size8=np.ones(4, bool))


def test_collects_finished_runs_only_and_round_trips(tmp_path):
    root = str(tmp_path / "runs")
    _fake_run(root, STUDY.arms[0], 0)
    _fake_run(root, STUDY.arms[0], 1)
    _fake_run(root, STUDY.arms[1], 0, finished=False)
    rows = training_curves.collect(STUDY, root, seeds=3)
    assert {(r["arm"], r["seed"]) for r in rows} == {("a", 0), ("a", 1)}
    assert [r["step"] for r in rows if r["seed"] == 0] == [10, 20, 30]  # eval line left out
    path = str(tmp_path / "training.csv")
    curves_csv.write_csv(rows, path)
    back = curves_csv.read_csv(path)
    assert [(r["arm"], r["seed"], r["step"]) for r in back] == [
        (r["arm"], r["seed"], r["step"]) for r in rows
    ]
    np.testing.assert_allclose([r["loss"] for r in back], [r["loss"] for r in rows], rtol=1e-5)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    root = str(tmp_path / "runs")
    for arm in STUDY.arms:
        _fake_run(root, arm, 0)
    out = str(tmp_path / "training.png")
    training_curves.plot(STUDY, training_curves.collect(STUDY, root, seeds=1), out)
    assert os.path.getsize(out) > 1000


def test_held_out_accuracy_along_the_way_round_trips_and_plots(tmp_path):
    root = str(tmp_path / "runs")
    _fake_run(root, STUDY.arms[0], 0)
    workdir = lib.run_dir(root, STUDY.arms[0], 0, "cpu")
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:  # a later evaluation
        f.write(json.dumps({"step": 60, "loss": 0.1, "size8/accuracy": 0.75}) + "\n")
    held_out = training_curves.collect_held_out(STUDY, root, seeds=1)
    assert [(r["step"], r["eval"], r["accuracy"]) for r in held_out] == [
        (30, "size8", 0.5),
        (60, "size8", 0.75),
    ]
    assert curves_csv.has_curve(held_out)
    assert not curves_csv.has_curve(held_out[:1])  # one point per run is no curve
    path = str(tmp_path / "held_out.csv")
    curves_csv.write_csv(held_out, path, curves_csv.HELD_OUT_COLUMNS)
    back = curves_csv.read_csv(path)
    assert [(r["step"], r["accuracy"]) for r in back] == [(30, 0.5), (60, 0.75)]
    pytest.importorskip("matplotlib")
    out = str(tmp_path / "held_out.png")
    training_curves.plot_held_out(STUDY, back, out, lines=((0.25, "chance"),))
    assert os.path.getsize(out) > 1000


def test_held_out_plot_gets_the_studys_reference_lines(tmp_path, monkeypatch):
    """`main` draws a study's chance and position-blind ceiling on held_out.png, as `run
    --report` does on accuracy.png."""
    directory = tmp_path / "volumes_long"
    directory.mkdir()
    rows = [
        dict(arm="ape", seed=0, step=s, epoch=s / 10, loss=1.0, train_accuracy=0.3)
        for s in (10, 20)
    ]
    curves_csv.write_csv(rows, str(directory / "training.csv"))
    held_out = [dict(arm="ape", seed=0, step=s, eval="g6", accuracy=0.3) for s in (10, 20)]
    curves_csv.write_csv(held_out, str(directory / "held_out.csv"), curves_csv.HELD_OUT_COLUMNS)
    drawn = []
    monkeypatch.setattr(training_curves, "plot", lambda *args: None)
    monkeypatch.setattr(training_curves, "plot_held_out", lambda *args: drawn.append(args[-1]))
    argv = ["volumes_long", "--results", str(tmp_path), "--from-csv"]
    assert training_curves.main(argv) == 0
    assert drawn == [report.REFERENCE_LINES["volumes_long"]] and len(drawn[0]) == 2


def test_runs_whose_workdirs_are_gone_stay_in_the_csv(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setitem(training_curves.STUDIES, STUDY.name, STUDY)
    results, first, second = (str(tmp_path / d) for d in ("results", "first", "second"))
    _fake_run(first, STUDY.arms[1], 0)
    _fake_run(first, STUDY.arms[0], 0)
    argv = ["toy", "--results", results, "--seeds", "2"]
    assert training_curves.main([*argv, "--root", first]) == 0
    path = os.path.join(results, "toy", "training.csv")
    before = curves_csv.read_csv(path)
    # Another machine: arm a's seed 0 again (its rows replace the CSV's) and its seed 1; arm
    # b's workdir is gone, and its rows stay.
    _fake_run(second, STUDY.arms[0], 0)
    _fake_run(second, STUDY.arms[0], 1)
    metrics = os.path.join(lib.run_dir(second, STUDY.arms[0], 0, "cpu"), "metrics.jsonl")
    with open(metrics, "a") as f:
        f.write(json.dumps(dict(step=40, epoch=1.3, loss=0.01, train_accuracy=0.9)) + "\n")
    assert training_curves.main([*argv, "--root", second]) == 0
    after = curves_csv.read_csv(path)
    runs = [("a", 0)] * 4 + [("a", 1)] * 3 + [("b", 0)] * 3  # in the study's arm order
    assert [(r["arm"], r["seed"]) for r in after] == runs
    assert [r["step"] for r in after if (r["arm"], r["seed"]) == ("a", 0)] == [10, 20, 30, 40]
    assert [r for r in after if r["arm"] == "b"] == [r for r in before if r["arm"] == "b"]


def test_record_run_adds_a_run_replaces_its_rows_and_writes_held_out_for_a_curve(tmp_path):
    root, directory = str(tmp_path / "runs"), str(tmp_path / "toy")
    names = STUDY.arm_names
    for arm in STUDY.arms:
        _fake_run(root, arm, 0)
    for arm in reversed(STUDY.arms):  # recorded out of the study's order
        curves_csv.record_run(
            directory, names, arm.name, 0, lib.run_dir(root, arm, 0, "cpu"), STUDY.evals
        )
    rows = curves_csv.read_csv(os.path.join(directory, "training.csv"))
    assert [(r["arm"], r["step"]) for r in rows] == [(a, s) for a in "ab" for s in (10, 20, 30)]
    assert not os.path.exists(os.path.join(directory, "held_out.csv"))  # one point: no curve
    workdir = lib.run_dir(root, STUDY.arms[0], 0, "cpu")
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 40, "size8/accuracy": 0.75}) + "\n")
    curves_csv.record_run(directory, names, "a", 0, workdir, STUDY.evals)
    assert len(curves_csv.read_csv(os.path.join(directory, "training.csv"))) == 6  # replaced
    held_out = curves_csv.read_csv(os.path.join(directory, "held_out.csv"))
    assert [(r["arm"], r["step"], r["accuracy"]) for r in held_out] == [
        ("a", 30, 0.5),
        ("a", 40, 0.75),
    ]  # b's one point is no curve
