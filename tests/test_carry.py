"""``experiments/studies/carry.py``: an unfinished run packed with its newest checkpoint only,
put back on another machine unless the run there is as far or finished, and dropped once the
run has finished; and the runner's ``--pack``, unpack and prune. The resumed run's numbers:
``test_train.py::test_a_carried_run_resumes_to_the_uninterrupted_end``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time

import numpy as np
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
    assert carry.read_manifest(path)["step"] == 200
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
    assert lib.newest_step(behind) == 300
    assert carry.unpack(study, str(runs), log=lambda _: None) == []  # as far: kept
    ahead = _workdir(tmp_path / "c", steps=(400,))
    assert carry.unpack(study, str(tmp_path / "c"), log=lambda _: None) == []
    assert lib.newest_step(ahead) == 400
    finished = _workdir(tmp_path / "d", steps=(100,))
    _finish(finished)
    assert carry.unpack(study, str(tmp_path / "d"), log=lambda _: None) == []
    assert lib.newest_step(finished) == 100


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


def test_an_archive_not_written_by_pack_is_refused(tmp_path):
    path = tmp_path / "two.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(_workdir(tmp_path), arcname="two")
    with pytest.raises(ValueError, match="no carry.json; expected an archive written by"):
        carry.read_manifest(str(path))


def test_an_ensemble_travels_with_its_members_and_is_pruned_when_all_have_finished(tmp_path):
    here, there, study = tmp_path / "here", str(tmp_path / "there"), str(tmp_path / "study")
    ensemble = _workdir(here, "arm_seeds0-1_abc", steps=(100, 200))
    members = [_workdir(here, f"arm_seed{k}_abc", steps=()) for k in (0, 1)]
    path, step = carry.pack(ensemble, study, members)
    manifest = carry.read_manifest(path)
    assert step == 200 and manifest == {
        "lead": "arm_seeds0-1_abc",
        "runs": ["arm_seed0_abc", "arm_seed1_abc"],
        "step": 200,
    }
    assert carry.unpack(study, there, log=lambda _: None) == [
        os.path.join(there, "arm_seeds0-1_abc")
    ]
    assert sorted(os.listdir(there)) == ["arm_seed0_abc", "arm_seed1_abc", "arm_seeds0-1_abc"]
    assert lib.newest_step(os.path.join(there, "arm_seeds0-1_abc")) == 200
    assert os.path.exists(os.path.join(there, "arm_seed1_abc", "metrics.jsonl"))
    _finish(os.path.join(there, "arm_seed0_abc"))
    assert carry.prune(study, there) == []  # seed 1 still training
    _finish(os.path.join(there, "arm_seed1_abc"))
    assert carry.prune(study, there) == [path]


def test_pack_refuses_runs_outside_the_leads_runs_directory(tmp_path):
    lead, stray = _workdir(tmp_path / "a", "ens"), _workdir(tmp_path / "b", "member")
    with pytest.raises(ValueError, match="member: not in .*a, the runs directory of"):
        carry.pack(lead, str(tmp_path / "study"), [stray])


def test_pack_names_a_member_workdir_that_is_missing(tmp_path):
    lead = _workdir(tmp_path, "arm_seeds0-1_abc")
    member = _workdir(tmp_path, "arm_seed0_abc", steps=())
    gone = str(tmp_path / "arm_seed1_abc")
    with pytest.raises(ValueError, match="arm_seed1_abc: no such workdir to carry with .*seeds0-1"):
        carry.pack(lead, str(tmp_path / "study"), [member, gone])
    assert not os.path.exists(tmp_path / "study")  # nothing half-written


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


def _one_arm_study(name, tmp_path, monkeypatch, trainer: str | None = None) -> lib.Arm:
    """A study `name` of one arm, known to the runner; `trainer`: a script that stands in for
    rope_lie.main, run with the workdir as its argument."""
    arm = lib.Arm("a", "a", "digits", "pe=a")
    study = lib.Study(name=name, title=name, arms=(arm,), evals=("test",))
    monkeypatch.setitem(run.STUDIES, name, study)
    if trainer is not None:
        script = tmp_path / "fake_main.py"
        script.write_text(trainer)
        monkeypatch.setattr(
            lib,
            "command",
            lambda arm, seed, scale, workdir, extra=(): [sys.executable, str(script), workdir],
        )
    return arm


def test_the_runner_packs_then_resumes_the_carried_run_and_prunes_it(tmp_path, monkeypatch):
    arm = _one_arm_study("carried", tmp_path, monkeypatch, FINISH_IF_CARRIED)
    monkeypatch.setattr(run, "write_report", lambda *a, **k: "")
    results = str(tmp_path / "results")
    here, there = str(tmp_path / "here"), str(tmp_path / "there")
    workdir = lib.run_dir(here, arm, 0, "cpu")
    _workdir(os.path.dirname(workdir), os.path.basename(workdir))
    args = ["carried", "--seeds", "1", "--results", results]
    assert run.main([*args, "--root", here, "--pack"]) == 0
    archive = carry.archive_path(os.path.join(results, "carried"), workdir)
    assert carry.read_manifest(archive)["step"] == 200

    assert run.main([*args, "--root", there]) == 0  # a new machine: nothing under its root
    assert lib.is_finished(lib.run_dir(there, arm, 0, "cpu"))
    assert not os.path.exists(archive)
    assert [r["arm"] for r in lib.read_results(os.path.join(results, "carried"))] == ["a"]


def test_the_runner_packs_an_arms_seed_ensemble_as_one_archive(tmp_path, monkeypatch):
    arm = _one_arm_study("carried", tmp_path, monkeypatch)
    root, results = str(tmp_path / "root"), str(tmp_path / "results")
    ensemble = lib.ensemble_dir(root, arm, [0, 1], "cpu")
    _workdir(os.path.dirname(ensemble), os.path.basename(ensemble), steps=(300,))
    for seed in (0, 1):
        member = lib.run_dir(root, arm, seed, "cpu")
        _workdir(os.path.dirname(member), os.path.basename(member), steps=())
    assert (
        run.main(["carried", "--seeds", "2", "--results", results, "--root", root, "--pack"]) == 0
    )
    [archive] = os.listdir(os.path.join(results, "carried", "unfinished"))
    manifest = carry.read_manifest(os.path.join(results, "carried", "unfinished", archive))
    assert manifest["lead"] == os.path.basename(ensemble) and manifest["step"] == 300
    assert manifest["runs"] == [os.path.basename(lib.run_dir(root, arm, s, "cpu")) for s in (0, 1)]


def test_pack_carries_an_unfinished_ensemble_whatever_the_seeds_asked(tmp_path, monkeypatch):
    """The ensemble of seeds 0 and 1 is carried by a --pack with --seeds 1 or 3 as with 2
    (before, --pack looked only for the ensemble of the seeds it was given and carried
    nothing); an ensemble stopped before its first checkpoint holds nothing to carry."""
    arm = _one_arm_study("carried", tmp_path, monkeypatch)
    root, results = str(tmp_path / "root"), str(tmp_path / "results")
    ensemble = lib.ensemble_dir(root, arm, [0, 1], "cpu")
    _workdir(os.path.dirname(ensemble), os.path.basename(ensemble), steps=(300,))
    empty = lib.ensemble_dir(root, arm, [0, 1, 2], "cpu")  # stopped before its first save
    _workdir(os.path.dirname(empty), os.path.basename(empty), steps=())
    members = [lib.run_dir(root, arm, s, "cpu") for s in (0, 1, 2)]
    for member in members:
        _workdir(os.path.dirname(member), os.path.basename(member), steps=())
    for seeds in ("1", "3"):
        args = ["carried", "--seeds", seeds, "--results", results, "--root", root, "--pack"]
        assert run.main(args) == 0
        folder = os.path.join(results, "carried", "unfinished")
        assert os.listdir(folder) == [os.path.basename(ensemble) + carry.SUFFIX]
        manifest = carry.read_manifest(os.path.join(folder, os.listdir(folder)[0]))
        assert manifest["step"] == 300
        assert manifest["runs"] == [os.path.basename(m) for m in members[:2]]


# Stands in for a run that saves its next step on SIGTERM, which takes a while, then exits 0.
SAVES_ON_SIGTERM = r"""
import os, signal, sys, time
workdir = sys.argv[1]
os.makedirs(workdir, exist_ok=True)
def stopped(*_):
    time.sleep(0.5)
    open(os.path.join(workdir, "saved"), "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, stopped)
open(os.path.join(workdir, "started"), "w").close()
time.sleep(60)
"""


def _terminate_once_started(workdir):
    """SIGTERM to this process (the runner) once the stand-in run has written ``started``."""

    def terminate():
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(workdir, "started")):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate, daemon=True).start()


def test_sigterm_stops_the_runner_once_its_runs_have_saved(tmp_path, monkeypatch):
    arm = _one_arm_study("stopped", tmp_path, monkeypatch, SAVES_ON_SIGTERM)
    root = str(tmp_path / "root")
    workdir = lib.run_dir(root, arm, 0, "cpu")

    before = signal.getsignal(signal.SIGTERM)
    _terminate_once_started(workdir)
    with pytest.raises(SystemExit, match="SIGTERM: the runs in progress save their next step"):
        run.main(["stopped", "--seeds", "1", "--root", root, "--results", str(tmp_path / "r")])
    assert os.path.exists(os.path.join(workdir, "saved"))  # waited for
    assert signal.getsignal(signal.SIGTERM) == before


# Stands in for a run in its final evaluation when SIGTERM comes: it finishes, then exits 0.
FINISHES_ON_SIGTERM = r"""
import json, os, signal, sys, time
import numpy as np
workdir = sys.argv[1]
os.makedirs(workdir, exist_ok=True)
def finish(*_):
    np.savez(os.path.join(workdir, "eval_examples.npz"), test=np.ones(4, bool))
    with open(os.path.join(workdir, "final.json"), "w") as f:
        json.dump({"step": 300, "evals": {"test": {"accuracy": 1.0, "num_examples": 4}}}, f)
    sys.exit(0)
signal.signal(signal.SIGTERM, finish)
open(os.path.join(workdir, "started"), "w").close()
time.sleep(60)
"""
UNCARRIED = FINISH_IF_CARRIED.replace(
    'assert os.path.isdir(os.path.join(workdir, "checkpoints", "200")), os.listdir(workdir)\n', ""
)


def test_a_run_that_finishes_in_its_sigterm_grace_is_recorded(tmp_path, monkeypatch):
    """Stopped in its final seconds, a run may finish before it exits: it is recorded, not left
    in a workdir that the machine may take with it."""
    arm = _one_arm_study("graced", tmp_path, monkeypatch, FINISHES_ON_SIGTERM)
    root, results = str(tmp_path / "root"), str(tmp_path / "r")
    workdir = lib.run_dir(root, arm, 0, "cpu")

    _terminate_once_started(workdir)
    with pytest.raises(SystemExit, match="SIGTERM"):
        run.main(["graced", "--seeds", "1", "--root", root, "--results", results])
    assert lib.is_finished(workdir)
    assert [(r["arm"], r["seed"]) for r in lib.read_results(os.path.join(results, "graced"))] == [
        ("a", 0)
    ]


def test_pack_records_a_finished_run_the_results_lack(tmp_path, monkeypatch):
    """A run that finished after the runner stopped (or whose recording was cut short) is
    recorded by --pack, so the study folder carries it; before, pack said there was nothing."""
    arm = _one_arm_study("finished", tmp_path, monkeypatch)
    root, results = str(tmp_path / "root"), str(tmp_path / "r")
    workdir = lib.run_dir(root, arm, 0, "cpu")
    os.makedirs(workdir)
    subprocess.run([sys.executable, "-c", UNCARRIED, workdir], check=True)
    assert (
        run.main(["finished", "--seeds", "1", "--root", root, "--results", results, "--pack"]) == 0
    )
    recorded = lib.read_results(os.path.join(results, "finished"))
    assert [(r["arm"], r["seed"], r["accuracy"]) for r in recorded] == [("a", 0, 1.0)]
    assert not os.path.exists(os.path.join(results, "finished", "unfinished"))


def test_a_recording_cut_short_before_results_csv_is_done_again_whole(tmp_path, monkeypatch):
    """results.csv is written last: killed while writing the examples, the run is not yet
    recorded and the next call records it whole (before, its rows were already in results.csv,
    the examples never came, and the runner counted it done)."""
    values = ["s", "a", 0, "test", 1.0, 4, 1.0, 3, 1.0, "8x8", "abc1234", "cpu"]
    rows = [dict(zip(lib.RESULT_COLUMNS, values, strict=True))]
    examples = {"a/0/test": np.ones(4, bool)}

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    directory = str(tmp_path / "s")
    with monkeypatch.context() as m:
        m.setattr(lib.np, "savez_compressed", killed)
        with pytest.raises(KeyboardInterrupt):
            lib.append_results(directory, rows, examples)
    assert lib.read_results(directory) == []
    lib.append_results(directory, rows, examples)
    assert len(lib.read_results(directory)) == 1
    np.testing.assert_array_equal(lib.read_examples(directory)["a/0/test"], examples["a/0/test"])


def test_an_unpack_cut_short_after_the_lead_is_done_again(tmp_path):
    """Killed between moving an ensemble's directory and its members', an unpack left the lead
    at the archive's step and no members, and was then skipped for good (the members restarted
    from nothing). The lead now goes in last, and a lead without all its runs is unpacked again;
    a staging folder left behind is removed."""
    here, there, study = tmp_path / "here", str(tmp_path / "there"), str(tmp_path / "study")
    ensemble = _workdir(here, "arm_seeds0-1_abc", steps=(100, 200))
    members = [_workdir(here, f"arm_seed{k}_abc", steps=()) for k in (0, 1)]
    carry.pack(ensemble, study, members)
    _workdir(there, "arm_seeds0-1_abc", steps=(200,))  # the lead alone, as the cut left it
    os.makedirs(os.path.join(there, ".unpack-x1", "arm_seed0_abc"))
    assert carry.unpack(study, there, log=lambda _: None) == [
        os.path.join(there, "arm_seeds0-1_abc")
    ]
    assert sorted(os.listdir(there)) == ["arm_seed0_abc", "arm_seed1_abc", "arm_seeds0-1_abc"]
    assert carry.unpack(study, there, log=lambda _: None) == []  # whole now: kept


def test_an_unpack_killed_midway_leaves_the_lead_out_and_is_done_again(tmp_path, monkeypatch):
    here, there, study = tmp_path / "here", str(tmp_path / "there"), str(tmp_path / "study")
    ensemble = _workdir(here, "arm_seeds0-1_abc", steps=(100, 200))
    members = [_workdir(here, f"arm_seed{k}_abc", steps=()) for k in (0, 1)]
    carry.pack(ensemble, study, members)
    real, moved = os.replace, []

    def killed_after_one(src, dst):
        if moved:
            raise KeyboardInterrupt
        moved.append(os.path.basename(dst))
        real(src, dst)

    with monkeypatch.context() as m:
        m.setattr(carry.os, "replace", killed_after_one)
        with pytest.raises(KeyboardInterrupt):
            carry.unpack(study, there, log=lambda _: None)
    assert moved == ["arm_seed0_abc"] and sorted(os.listdir(there)) == ["arm_seed0_abc"]
    assert carry.unpack(study, there, log=lambda _: None)  # the lead is missing: done again
    assert sorted(os.listdir(there)) == ["arm_seed0_abc", "arm_seed1_abc", "arm_seeds0-1_abc"]
