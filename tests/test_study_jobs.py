"""``lib.run_study``'s ``jobs``: runs trained side by side, each recorded as it finishes, a tool
arm recorded from its base arm's one run, a failure that stops the others (each to be
resumed), and the machine each run trained on. A stand-in trainer (a Python script writing what
``rope_lie.main`` writes) replaces the real one: what is tested is the runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
    results = tmp_path / "results"
    handled = lib.run_study(
        _study("a", "b"),
        seeds=1,
        scale="cpu",
        root=str(tmp_path / "runs"),
        study_dir=str(results),
        jobs=2,
        log=lambda *_: None,
    )
    assert sorted(handled) == [("a", 0), ("a_pi", 0), ("b", 0)]
    # both ran to the end, so each saw the other start: they ran side by side
    assert sorted(os.listdir(fake_trainer)) == ["a.end", "a.start", "b.end", "b.start"]
    rows = {(r["arm"], r["eval"]): r for r in lib.read_results(str(results))}
    assert rows["a", "test"]["accuracy"] == 0.5 and rows["a_pi", "test"]["accuracy"] == 0.25
    assert {r["cpu"] for r in rows.values()} == {"NVIDIA Test GPU gpu"}


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
