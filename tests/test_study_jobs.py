"""``lib.run_study``'s ``jobs``: runs trained side by side, each recorded as it finishes, a tool
arm recorded from its base arm's one run, a failure that stops the others (each to be
resumed), and the machine each run trained on. A stand-in trainer (a Python script writing what
``rope_lie.main`` writes) replaces the real one: what is tested is the runner."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from experiments.studies import lib

# Writes what collect() reads; logs its start and end; waits for a "go" file that the second
# run to start creates (so two runs that both finish were running at once), or, for a failing
# arm, exits 3 once the other run has started. A SIGTERM is logged and ends it with status 0,
# as rope_lie.main does after saving its next step.
FAKE = r"""
import json, os, signal, sys, time
import numpy as np
workdir, arm, log_dir = sys.argv[1], sys.argv[2], sys.argv[3]
def note(what):
    with open(os.path.join(log_dir, f"{arm}.{what}"), "w") as f:
        f.write(str(time.time()))
def stopped(*_):
    note("terminated")
    sys.exit(0)
signal.signal(signal.SIGTERM, stopped)
note("start")
started = lambda: len([n for n in os.listdir(log_dir) if n.endswith(".start")])
deadline = time.time() + 60
while started() < 2 and time.time() < deadline:
    time.sleep(0.05)
if arm == "broken":
    sys.exit(3)
if arm == "slow":
    time.sleep(60)
os.makedirs(workdir, exist_ok=True)
evals = {"test": {"accuracy": 0.5, "num_examples": 4}}
evals["test@pi"] = {"accuracy": 0.25, "num_examples": 4}
with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"step": 1, "throughput": 10.0}) + "\n")
np.savez(os.path.join(workdir, "eval_examples.npz"), **{k: np.ones(4, bool) for k in evals})
with open(os.path.join(workdir, "final.json"), "w") as f:
    json.dump({"step": 1, "evals": evals}, f)
note("end")
"""


def _study(*names: str) -> lib.Study:
    arms = [lib.Arm(n, n, "digits", f"pe={n}") for n in names]
    if "a" in names:  # a tool arm: the "@pi" evaluations of a's run
        arms.append(lib.Arm("a_pi", "a, pi", "digits", "pe=a", eval_suffix="@pi"))
    return lib.Study(name="jobs", title="jobs", arms=tuple(arms), evals=("test",))


@pytest.fixture
def fake_trainer(tmp_path, monkeypatch):
    """Runs the stand-in trainer instead of rope_lie.main; returns the directory of its logs."""
    logs = tmp_path / "logs"
    logs.mkdir()
    script = tmp_path / "fake_main.py"
    script.write_text(FAKE)

    def command(arm, seed, scale, workdir, extra=()):
        name = arm.arg.removeprefix("pe=")
        return [sys.executable, str(script), workdir, name, str(logs)]

    monkeypatch.setattr(lib, "command", command)
    monkeypatch.setattr(lib, "gpu_kind", lambda: "NVIDIA Test GPU")
    return logs


def test_two_jobs_train_at_once_and_a_tool_arm_reads_its_base_run(tmp_path, fake_trainer):
    results, log = tmp_path / "results", []
    handled = lib.run_study(
        _study("a", "b"),
        seeds=1,
        scale="cpu",
        root=str(tmp_path / "runs"),
        study_dir=str(results),
        jobs=2,
        log=log.append,
    )
    assert sorted(handled) == [("a", 0), ("a_pi", 0), ("b", 0)]
    # two jobs (a's run is also a_pi's), labelled as such
    assert {line.split(":")[0] for line in log[1:]} == {"[1/2] a seed 0", "[2/2] b seed 0"}
    # both ran to the end, so each saw the other start: they ran side by side
    assert sorted(os.listdir(fake_trainer)) == ["a.end", "a.start", "b.end", "b.start"]
    rows = {(r["arm"], r["eval"]): r for r in lib.read_results(str(results))}
    assert rows["a", "test"]["accuracy"] == 0.5 and rows["a_pi", "test"]["accuracy"] == 0.25
    assert {r["cpu"] for r in rows.values()} == {"NVIDIA Test GPU gpu"}


def test_a_run_trained_alone_from_step_0_is_no_longer_marked_as_an_ensembles(
    tmp_path, fake_trainer
):
    """A workdir whose ensemble stopped before its first checkpoint (so holds nothing) trains
    alone from step 0: its ensemble.json goes, and its rows do not say "+ensemble"."""
    study, root, log = _study("a", "b"), str(tmp_path / "runs"), []
    _stopped_ensemble(root, study.arm("a"), [0, 1], step=None)
    workdir = lib.run_dir(root, study.arm("a"), 0, "cpu")
    lib.run_study(
        study,
        seeds=1,
        scale="cpu",
        root=root,
        study_dir=str(tmp_path / "results"),
        jobs=2,
        log=log.append,
    )
    assert not os.path.exists(os.path.join(workdir, lib.ENSEMBLE_JSON))
    assert f"{workdir}: trained from step 0 alone, no longer in an ensemble" in log
    assert not any("+ensemble" in r["tree"] for r in lib.read_results(str(tmp_path / "results")))


def test_a_failed_run_stops_the_others_and_raises(tmp_path, fake_trainer):
    with pytest.raises(subprocess.CalledProcessError) as failed:
        lib.run_study(
            _study("broken", "slow"),
            seeds=1,
            scale="cpu",
            root=str(tmp_path / "runs"),
            study_dir=str(tmp_path / "results"),
            jobs=2,
            log=lambda *_: None,
        )
    assert failed.value.returncode == 3
    assert "slow.terminated" in os.listdir(fake_trainer)  # stopped, to be resumed
    assert lib.read_results(str(tmp_path / "results")) == []


@pytest.mark.parametrize("jobs", [0, -1, 1.5, True])
def test_jobs_must_be_a_positive_int(tmp_path, jobs):
    with pytest.raises(ValueError, match=f"jobs={jobs!r}; expected a positive int"):
        lib.run_study(
            _study("b"),
            seeds=1,
            scale="cpu",
            root=str(tmp_path),
            study_dir=str(tmp_path),
            jobs=jobs,
        )


def test_the_machine_is_the_gpu_where_nvidia_smi_names_one(monkeypatch, tmp_path):
    monkeypatch.setattr(lib, "gpu_kind", lambda: None)
    assert lib.machine_kind() == lib.cpu_kind()
    monkeypatch.setattr(lib, "gpu_kind", lambda: "NVIDIA H100 80GB HBM3")
    assert lib.machine_kind() == "NVIDIA H100 80GB HBM3 gpu"
    record = lib.record_provenance(str(tmp_path / "run"))
    with open(tmp_path / "run" / lib.PROVENANCE) as f:
        assert json.load(f) == record and record["cpu"] == "NVIDIA H100 80GB HBM3 gpu"


def test_a_run_resumed_on_other_trees_keeps_each_of_them(monkeypatch, tmp_path):
    workdir = str(tmp_path / "run")
    monkeypatch.setattr(lib, "machine_kind", lambda: "AMD EPYC avx512")
    for tree in ("aaa1111", "aaa1111", "bbb2222", "ccc3333", "bbb2222", "aaa1111"):
        monkeypatch.setattr(lib, "code_tree", lambda tree=tree: tree)
        record = lib.record_provenance(workdir)
    assert record["tree"] == "aaa1111"
    assert [r["tree"] for r in record["resumed_elsewhere"]] == ["bbb2222", "ccc3333"]
    assert lib._provenance(workdir) == ("aaa1111+resumed", "AMD EPYC avx512")
    # a record written when only the first other tree was kept gains the next one
    with open(os.path.join(workdir, lib.PROVENANCE), "w") as f:
        json.dump({"tree": "a", "cpu": "c", "resumed_elsewhere": {"tree": "b", "cpu": "c"}}, f)
    monkeypatch.setattr(lib, "code_tree", lambda: "d")
    record = lib.record_provenance(workdir)
    assert record["resumed_elsewhere"] == [
        {"tree": "b", "cpu": "c"},
        {"tree": "d", "cpu": "AMD EPYC avx512"},
    ]


# A stand-in ensemble trainer: writes what collect() reads (and ensemble.json, as
# rope_lie.ensemble does) into each of its workdirs and logs
# its seeds (`<arm>.seeds<a-b-c>`) and its start (which lets the next FAKE run start at once).
FAKE_ENSEMBLE = r"""
import json, os, sys
import numpy as np
workdirs, seeds, arm, log_dir = sys.argv[1].split(","), sys.argv[2], sys.argv[3], sys.argv[4]
open(os.path.join(log_dir, f"{arm}.seeds{seeds.replace(',', '-')}"), "w").close()
open(os.path.join(log_dir, f"{arm}.start"), "w").close()
evals = {"test": {"accuracy": 0.5, "num_examples": 4}}
evals["test@pi"] = {"accuracy": 0.25, "num_examples": 4}
for workdir in workdirs:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "ensemble.json"), "w") as f:
        json.dump({"seeds": [int(s) for s in seeds.split(",")], "dir": "ens"}, f)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 1, "throughput": 10.0}) + "\n")
    np.savez(os.path.join(workdir, "eval_examples.npz"), **{k: np.ones(4, bool) for k in evals})
    with open(os.path.join(workdir, "final.json"), "w") as f:
        json.dump({"step": 1, "evals": evals}, f)
"""


def _finish(workdir: str) -> None:
    """Write a finished run's files into `workdir`, as a seed trained earlier left them."""
    os.makedirs(workdir)
    evals = {"test": {"accuracy": 0.75, "num_examples": 4}}
    evals["test@pi"] = {"accuracy": 0.5, "num_examples": 4}
    with open(os.path.join(workdir, "final.json"), "w") as f:
        json.dump({"step": 1, "evals": evals}, f)
    np.savez(os.path.join(workdir, "eval_examples.npz"), **{k: np.ones(4, bool) for k in evals})


def test_ensemble_trains_an_arms_pending_seeds_as_one_job(tmp_path, fake_trainer, monkeypatch):
    """With ensemble=True each arm's seeds still to train are one ensemble job (a seed already
    finished is recorded, not retrained); its tool arm is recorded from the members' workdirs;
    an arm with one seed left runs rope_lie.main."""
    script = tmp_path / "fake_ensemble.py"
    script.write_text(FAKE_ENSEMBLE)

    def ensemble_command(arm, seeds, scale, workdirs, directory, extra=()):
        name = arm.arg.removeprefix("pe=")
        assert directory == lib.ensemble_dir(str(tmp_path / "runs"), arm, seeds, scale)
        args = [",".join(workdirs), ",".join(map(str, seeds)), name, str(fake_trainer)]
        return [sys.executable, str(script), *args]

    monkeypatch.setattr(lib, "ensemble_command", ensemble_command)
    study, root = _study("a", "b"), str(tmp_path / "runs")
    _finish(lib.run_dir(root, study.arm("a"), 1, "cpu"))
    for seed in (0, 1):
        _finish(lib.run_dir(root, study.arm("b"), seed, "cpu"))
    handled = lib.run_study(
        study,
        seeds=3,
        scale="cpu",
        root=root,
        study_dir=str(tmp_path / "results"),
        log=lambda *_: None,
        ensemble=True,
    )
    assert sorted(handled) == sorted((a, s) for a in ("a", "a_pi", "b") for s in range(3))
    # arm a: seeds 0 and 2 in one job; arm b: seed 2 alone, by the single-run trainer
    assert sorted(os.listdir(fake_trainer)) == ["a.seeds0-2", "a.start", "b.end", "b.start"]
    rows = {
        (r["arm"], r["seed"]): r["accuracy"] for r in lib.read_results(str(tmp_path / "results"))
    }
    assert rows["a", 0] == rows["a", 2] == 0.5 and rows["a", 1] == 0.75
    assert rows["a_pi", 0] == rows["a_pi", 2] == 0.25
    # the tree column says which seeds the ensemble trained (the others' is the code tree)
    trees = {(r["arm"], r["seed"]): r["tree"] for r in lib.read_results(str(tmp_path / "results"))}
    ensemble = {(a, s) for a in ("a", "a_pi") for s in (0, 2)}
    assert {k for k, tree in trees.items() if tree.endswith("+ensemble")} == ensemble
    assert {lib.split_tree(tree)[0] for tree in trees.values()} - {""} == {lib.code_tree()}


def test_ensemble_dry_run_prints_one_command_per_arm(tmp_path):
    """The grouped commands: one rope_lie.ensemble line per arm with its seeds, its members'
    workdirs (the single runs' names) and its ensemble directory; a data stream's seeds are
    passed as --data_seeds; the tool arm adds no command of its own."""
    arms = (
        lib.Arm("a", "a", "fashion_mnist", "pe=ape,input=memory", (("num_epochs", 2),)),
        lib.Arm("a_pi", "a, pi", "fashion_mnist", "pe=ape,input=memory", (("num_epochs", 2),)),
        lib.Arm("s", "s", "fashion_mnist", "pe=rope,input=memory", data_stream=2),
    )
    arms = (*arms[:1], dataclasses.replace(arms[1], eval_suffix="@pi"), arms[2])
    study = lib.Study(name="dry", title="dry", arms=arms, evals=("test",))
    log, root = [], str(tmp_path / "runs")
    lib.run_study(
        study,
        seeds=3,
        scale="cpu",
        root=root,
        study_dir=str(tmp_path),
        dry_run=True,
        log=log.append,
        ensemble=True,
        extra_flags=["--config.progress=False"],
    )
    cmds = [line for line in log if "rope_lie" in line and not line.startswith("#")]
    assert len(cmds) == 2 and all("-m rope_lie.ensemble " in c for c in cmds)
    # the labels count jobs (two), not (arm, seed) pairs (nine, with the tool arm's)
    assert [line for line in log if line.startswith("#")] == [
        "# [1/2] a seeds 0,1,2 (one ensemble)",
        "# [2/2] s seeds 0,1,2 (one ensemble)",
    ]
    for cmd, arm in zip(cmds, (arms[0], arms[2]), strict=True):
        workdirs = [lib.run_dir(root, arm, s, "cpu") for s in range(3)]
        assert f"--workdirs={','.join(workdirs)} " in cmd
        assert f"--ensemble_dir={lib.ensemble_dir(root, arm, [0, 1, 2], 'cpu')} " in cmd
        assert "--seeds=0,1,2 " in cmd and cmd.endswith(" --config.progress=False")
    assert "--config.num_epochs=2" in cmds[0] and "--data_seeds" not in cmds[0]
    assert "--data_seeds=2000,2001,2002" in cmds[1]
    assert lib.ensemble_dir(root, arms[0], [0, 2], "cpu") != lib.ensemble_dir(
        root, arms[0], [0, 1, 2], "cpu"
    )


@pytest.fixture
def fake_ensemble(tmp_path, fake_trainer, monkeypatch):
    """Runs FAKE_ENSEMBLE instead of rope_lie.ensemble; returns the ensemble directories of the
    commands made, in order."""
    script = tmp_path / "fake_ensemble.py"
    script.write_text(FAKE_ENSEMBLE)
    given = []

    def ensemble_command(arm, seeds, scale, workdirs, directory, extra=()):
        given.append(directory)
        args = [",".join(workdirs), ",".join(map(str, seeds)), arm.name, str(fake_trainer)]
        return [sys.executable, str(script), *args]

    monkeypatch.setattr(lib, "ensemble_command", ensemble_command)
    return given


def _stopped_ensemble(root: str, arm: lib.Arm, seeds, step: int | None = 20) -> str:
    """What a stopped ``rope_lie.ensemble`` of `arm`'s `seeds` leaves: its directory with a
    stacked checkpoint at `step` (None: stopped before its first), and member workdirs with
    metrics and ``ensemble.json`` but no checkpoint of their own; returns the directory."""
    directory = lib.ensemble_dir(root, arm, seeds, "cpu")
    os.makedirs(os.path.join(directory, "checkpoints", "" if step is None else str(step)))
    for seed in seeds:
        workdir = lib.run_dir(root, arm, seed, "cpu")
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"step": 10}) + "\n")
        with open(os.path.join(workdir, lib.ENSEMBLE_JSON), "w") as f:
            json.dump({"seeds": list(seeds), "dir": directory}, f)
    return directory


def _held_study() -> lib.Study:
    """Arm a, and arm b: the same recipe and argument (the same readable name) but other
    overrides, so other runs and ensembles. Their recipe builds (a dry run builds it)."""
    a = lib.Arm("a", "a", "digits", "pe=ape,smoke")
    b = lib.Arm("b", "b", "digits", "pe=ape,smoke", (("model.dropout", 0.1),))
    return lib.Study(name="held", title="held", arms=(a, b), evals=("test",))


@pytest.mark.parametrize(
    "seeds, ensemble, dry_run, how",
    [
        (3, True, False, r"as the ensemble of seeds \[0, 1, 2\]"),
        (1, True, False, r"alone \(rope_lie.main\)"),
        (2, False, False, r"alone \(rope_lie.main\)"),
        (3, True, True, r"as the ensemble of seeds \[0, 1, 2\]"),
        (2, False, True, r"alone \(rope_lie.main\)"),
    ],
)
def test_seeds_an_unfinished_ensemble_holds_train_only_as_that_ensemble(
    tmp_path, fake_trainer, fake_ensemble, seeds, ensemble, dry_run, how
):
    """A rerun with other --seeds (or without --ensemble) would train the seeds of a stopped
    ensemble from step 0 in the workdirs it writes (before, it did: a second ensemble beside
    the first, which could then no longer resume); it is refused, naming the ensemble, its
    seeds and step, and what to do. Nothing is trained."""
    study, root = _held_study(), str(tmp_path / "runs")
    held = _stopped_ensemble(root, study.arm("a"), [0, 1])
    with pytest.raises(SystemExit) as refused:
        lib.run_study(
            study,
            seeds=seeds,
            scale="cpu",
            root=root,
            study_dir=str(tmp_path / "results"),
            dry_run=dry_run,
            ensemble=ensemble,
            log=lambda *_: None,
        )
    text = str(refused.value)
    assert text.startswith(f"a seed 0 is part-trained in the seed ensemble {held} ")
    assert "(seeds [0, 1], step 20)" in text and re.search(f"would train it {how}", text)
    assert "Rerun with --ensemble --seeds 2 to finish it, --pack to carry it" in text
    assert f"or remove {held} to train seeds [0, 1] afresh" in text
    assert os.listdir(fake_trainer) == []  # nothing trained


def test_the_same_seeds_resume_their_ensemble(tmp_path, fake_trainer, fake_ensemble):
    """--seeds 2 --ensemble resumes the ensemble of seeds 0 and 1; arm b (the same name but
    other overrides) is not held by a's ensemble; an ensemble stopped before its first
    checkpoint, or whose member holds its own final state, holds nothing."""
    study, root = _held_study(), str(tmp_path / "runs")
    held = _stopped_ensemble(root, study.arm("a"), [0, 1])
    _stopped_ensemble(root, study.arm("b"), [0, 1, 2], step=None)
    lib.run_study(
        study,
        seeds=2,
        scale="cpu",
        root=root,
        study_dir=str(tmp_path / "results"),
        ensemble=True,
        log=lambda *_: None,
    )
    assert fake_ensemble == [held, lib.ensemble_dir(root, study.arm("b"), [0, 1], "cpu")]
    assert {(r["arm"], r["seed"]) for r in lib.read_results(str(tmp_path / "results"))} == {
        (a, s) for a in "ab" for s in (0, 1)
    }
    arm = study.arm("a")
    _stopped_ensemble(root, arm, [2, 3])
    assert [e.held for e in lib.ensembles_in_progress(root, arm, "cpu")] == [[2, 3]]
    os.makedirs(os.path.join(lib.run_dir(root, arm, 3, "cpu"), "checkpoints", "20"))
    assert [e.held for e in lib.ensembles_in_progress(root, arm, "cpu")] == [[2]]


def test_two_ensembles_that_hold_one_seed_are_named_with_the_way_out(tmp_path, fake_ensemble):
    """Left by a rerun with other seeds before the runner refused it: each ensemble would cut
    the workdirs' metrics the other wrote, so the runner names both and resumes neither."""
    study, root = _held_study(), str(tmp_path / "runs")
    first = _stopped_ensemble(root, study.arm("a"), [0, 1])
    second = _stopped_ensemble(root, study.arm("a"), [0, 1, 2], step=40)
    for seeds in (2, 3):
        with pytest.raises(SystemExit) as refused:
            lib.run_study(
                study,
                seeds=seeds,
                scale="cpu",
                root=root,
                study_dir=str(tmp_path / "results"),
                ensemble=True,
                log=lambda *_: None,
            )
        assert str(refused.value).startswith(
            f"a seed 0 is part-trained in 2 seed ensembles: {second} (seeds [0, 1, 2], step 40);"
            f" {first} (seeds [0, 1], step 20). They write the same workdirs, so at most one "
            "can resume: keep the one that the seed's workdir's ensemble.json names"
        )
