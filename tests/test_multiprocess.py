"""A real multi-process job on this machine: 2 processes x 2 CPU devices (gloo collectives).

`python -m rope_lie.main` is started twice with `config.distributed` (coordinator on localhost),
as docs/training.md shows, on the reference run's config (``helpers.digits_config``: 2 data shards,
eval batches of 30 that 4 devices read as 32, padded). The job must train exactly as the
reference run does in one process on the same global batches, evaluate, write its files once
(process 0), checkpoint jointly, and its checkpoint must resume in one process on one device;
the reference's resumes on a 4-device FSDP mesh.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from rope_lie import checkpoint, metrics, train
from tests import helpers

STEPS = helpers.REFERENCE["total_steps"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_process_run(tfds_dir, tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("two_processes"))
    port = _free_port()
    flags = helpers.reference_flags(tfds_dir) + [f"--workdir={workdir}", "--config.progress=True"]
    flags.append("--config.eval_every_steps=0")  # evaluated once, at the end: final.json
    flags += [
        f"--config.distributed.coordinator_address=localhost:{port}",
        "--config.distributed.num_processes=2",
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "rope_lie.main", *flags, f"--config.distributed.process_id={i}"],
            cwd=helpers.REPO,
            env=helpers.subprocess_env(devices=2),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-4000:]
    return workdir, outs


def test_two_processes_train_as_one(two_process_run, reference_run):
    workdir, outs = two_process_run
    ref_dir, ref = reference_run
    records = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    ref_records = metrics.read_jsonl(os.path.join(ref_dir, "metrics.jsonl"))
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10, 12]  # written once, by process 0
    np.testing.assert_allclose(
        [r["loss"] for r in records], [r["loss"] for r in ref_records], rtol=1e-5
    )
    helpers.assert_same_checkpoints(workdir, ref_dir, params_only=True, atol=2e-5)
    with open(os.path.join(workdir, "final.json")) as f:
        final = json.load(f)
    for name, res in ref["evals"].items():  # every test digit once, padding masked out
        assert final["evals"][name]["num_examples"] == res["num_examples"] == 360
        assert final["evals"][name]["accuracy"] == pytest.approx(res["accuracy"], abs=1 / 360)
    # Per example, in the split's order (each process reads a contiguous part of it): the
    # paired tests compare runs example by example, whatever their process count. The models
    # agree to float rounding, so all but a digit or two agree; out of order, near chance.
    with (
        np.load(os.path.join(workdir, metrics.EXAMPLES_FILE)) as examples,
        np.load(os.path.join(ref_dir, metrics.EXAMPLES_FILE)) as ref_examples,
    ):
        for name in ref["evals"]:
            assert np.mean(examples[name] == ref_examples[name]) > 0.99, name
    assert "mesh of 4 cpu devices in 2 processes" in outs[0]
    assert "eval " in outs[0] and "eval " not in outs[1]  # the table and the bar: process 0
    assert "step/s" in outs[0] or "s/step" in outs[0]
    assert "s/step" not in outs[1] and "step/s" not in outs[1]
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["12", "8"]  # one set


def test_the_two_process_checkpoint_resumes_in_one_process(two_process_run, tfds_dir, tmp_path):
    """Restore on another topology: drop the last checkpoint of the 2-process job and let one
    process on one device redo steps 9-12 from step 8; it ends where the job ended."""
    workdir, _ = two_process_run
    resumed = str(tmp_path / "resumed")
    assert helpers.copy_without_last_checkpoint(workdir, resumed) == 8
    train.train_and_evaluate(helpers.digits_config(tfds_dir), resumed)
    assert checkpoint.load_state(os.path.join(resumed, "checkpoints"))[0] == STEPS
    helpers.assert_same_checkpoints(resumed, workdir, params_only=True, atol=2e-5)


def test_a_one_device_checkpoint_resumes_on_a_4_device_fsdp_mesh(reference_run, tfds_dir, tmp_path):
    """The other direction: the 1-device reference run's step-8 checkpoint resumes in a process
    with 4 devices on a data=1 x fsdp=4 mesh (parameters sharded) and ends at its step 12."""
    ref_dir, _ = reference_run
    resumed = str(tmp_path / "fsdp")
    helpers.copy_without_last_checkpoint(ref_dir, resumed)
    flags = helpers.reference_flags(tfds_dir)  # data_shards=2: the same batches
    flags += ["--config.mesh.data=1", "--config.mesh.fsdp=4", "--config.fsdp_min_size=256"]
    # digits:smoke evaluates size8_shuffled too; the reference run does not.
    proc = subprocess.run(
        [sys.executable, "-m", "rope_lie.main", *flags, f"--workdir={resumed}"],
        cwd=helpers.REPO,
        env=helpers.subprocess_env(devices=4),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Resuming from step 8" in proc.stdout + proc.stderr
    assert "data=1 x fsdp=4 mesh of 4 cpu devices" in proc.stdout + proc.stderr
    helpers.assert_same_checkpoints(resumed, ref_dir, params_only=True, atol=2e-5)
