"""``experiments/studies/carry.py``: an unfinished run packed with its newest checkpoint only,
put back on another machine unless the run there is as far or finished, and dropped once the
run has finished; and the runner's ``--pack``, unpack and prune. The resumed run's numbers:
``test_train.py::test_a_carried_run_resumes_to_the_uninterrupted_end``."""

from __future__ import annotations

import json
import os
import sys
import tarfile

import pytest

from experiments.studies import carry, lib, run


def _workdir(root, name="run_seed0_abc", steps=(100, 200)):
    workdir = os.path.join(root, name)
    os.makedirs(workdir, exist_ok=True)
    for step in steps:
        os.makedirs(os.path.join(workdir, "checkpoints", str(step), "state"))
        with open(os.path.join(workdir, "checkpoints", str(step), "state", "data"), "w") as f:
            f.write(f"state at {step}")
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": max(steps, default=0) + 7}) + "\n")
    with open(os.path.join(workdir, lib.PROVENANCE), "w") as f:
        json.dump({"tree": "abc", "cpu": "here"}, f)
    return workdir


def _files(top):
    return sorted(
        os.path.relpath(os.path.join(d, n), top) for d, _, names in os.walk(top) for n in names
    )


def _finish(workdir):
    for name in ("final.json", lib.EXAMPLES):
        open(os.path.join(workdir, name), "w").close()


def test_pack_keeps_the_newest_checkpoint_and_unpack_restores_the_run(tmp_path):
    workdir = _workdir(tmp_path / "machine_a")
    path, step = carry.pack(workdir, str(tmp_path / "study"))
    assert step == 200 and path == str(tmp_path / "study" / "unfinished" / "run_seed0_abc.tar.gz")
    assert carry.archived_step(path) == 200
    runs = str(tmp_path / "machine_b")
    assert carry.unpack(str(tmp_path / "study"), runs, log=lambda _: None) == [
        os.path.join(runs, "run_seed0_abc")
    ]
    restored = os.path.join(runs, "run_seed0_abc")
    expected = [f for f in _files(workdir) if not f.startswith(os.path.join("checkpoints", "100"))]
    assert _files(restored) == expected
    with open(os.path.join(restored, "checkpoints", "200", "state", "data")) as f:
        assert f.read() == "state at 200"
    assert not [n for n in os.listdir(runs) if n.startswith(".unpack")]


def test_unpack_replaces_a_run_behind_the_archive_and_keeps_one_as_far_or_finished(tmp_path):
    study = str(tmp_path / "study")
    carry.pack(_workdir(tmp_path / "a", steps=(300,)), study)
    runs = tmp_path / "b"
    behind = _workdir(runs, steps=(100,))
    assert carry.unpack(study, str(runs), log=lambda _: None) == [behind]
    assert carry.newest_step(behind) == 300
    assert carry.unpack(study, str(runs), log=lambda _: None) == []  # as far: kept
    ahead = _workdir(tmp_path / "c", steps=(400,))
    assert carry.unpack(study, str(tmp_path / "c"), log=lambda _: None) == []
    assert carry.newest_step(ahead) == 400
    finished = _workdir(tmp_path / "d", steps=(100,))
    _finish(finished)
    assert carry.unpack(study, str(tmp_path / "d"), log=lambda _: None) == []
    assert carry.newest_step(finished) == 100


def test_prune_drops_only_the_archives_of_finished_runs(tmp_path):
    study = str(tmp_path / "study")
    done, going = _workdir(tmp_path, "done_seed0"), _workdir(tmp_path, "going_seed0")
    for workdir in (done, going):
        carry.pack(workdir, study)
    _finish(done)
    assert carry.prune(study, str(tmp_path)) == [carry.archive_path(study, done)]
    assert os.listdir(os.path.join(study, "unfinished")) == ["going_seed0.tar.gz"]


def test_prune_drops_the_archive_of_a_recorded_run_whose_workdir_is_gone(tmp_path):
    study = str(tmp_path / "study")
    carry.pack(_workdir(tmp_path / "a", "copied_seed0"), study)
    assert carry.prune(study, str(tmp_path / "b")) == []
    assert carry.prune(study, str(tmp_path / "b"), recorded={"copied_seed0"}) == [
        carry.archive_path(study, "copied_seed0")
    ]


def test_pack_without_a_checkpoint_names_the_run(tmp_path):
    workdir = _workdir(tmp_path, steps=())
    with pytest.raises(ValueError, match="run_seed0_abc: no checkpoint to carry"):
        carry.pack(workdir, str(tmp_path / "study"))


def test_an_archive_with_two_steps_is_refused(tmp_path):
    path = tmp_path / "two.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(_workdir(tmp_path), arcname="two")
    with pytest.raises(ValueError, match=r"carries checkpoint steps \[100, 200\]; expected one"):
        carry.archived_step(str(path))


# Stands in for rope_lie.main: it fails unless the carried checkpoint is in its workdir, then
# writes what a finished run leaves.
FINISH_IF_CARRIED = r"""
import json, os, sys
import numpy as np
workdir = sys.argv[1]
assert os.path.isdir(os.path.join(workdir, "checkpoints", "200")), os.listdir(workdir)
np.savez(os.path.join(workdir, "eval_examples.npz"), test=np.ones(4, bool))
with open(os.path.join(workdir, "final.json"), "w") as f:
    json.dump({"step": 300, "evals": {"test": {"accuracy": 1.0, "num_examples": 4}}}, f)
"""


def test_the_runner_packs_then_resumes_the_carried_run_and_prunes_it(tmp_path, monkeypatch):
    arm = lib.Arm("a", "a", "digits", "pe=a")
    study = lib.Study(name="carried", title="carried", arms=(arm,), evals=("test",))
    monkeypatch.setitem(run.STUDIES, "carried", study)
    script = tmp_path / "fake_main.py"
    script.write_text(FINISH_IF_CARRIED)
    monkeypatch.setattr(
        lib,
        "command",
        lambda arm, seed, scale, workdir, extra=(): [sys.executable, str(script), workdir],
    )
    monkeypatch.setattr(run, "write_report", lambda *a, **k: "")
    results = str(tmp_path / "results")
    here, there = str(tmp_path / "here"), str(tmp_path / "there")
    workdir = lib.run_dir(here, arm, 0, "cpu")
    _workdir(os.path.dirname(workdir), os.path.basename(workdir))
    args = ["carried", "--seeds", "1", "--results", results]
    assert run.main([*args, "--root", here, "--pack"]) == 0
    archive = carry.archive_path(os.path.join(results, "carried"), workdir)
    assert carry.archived_step(archive) == 200

    assert run.main([*args, "--root", there]) == 0  # a new machine: nothing under its root
    assert lib.is_finished(lib.run_dir(there, arm, 0, "cpu"))
    assert not os.path.exists(archive)
    assert [r["arm"] for r in lib.read_results(os.path.join(results, "carried"))] == ["a"]
