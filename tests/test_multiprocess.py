"""A real multi-process job on this machine: 2 processes x 2 CPU devices (gloo collectives).

`python -m rope_lie.main` is started twice with `config.distributed` (coordinator on localhost),
as the README shows. The job must train exactly as one process does on the same global batches,
evaluate with an eval batch size that does not divide the mesh (padded), write its files once
(process 0), checkpoint jointly, and its checkpoint must resume in one process on one device.
"""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from rope_lie import checkpoint, metrics, train
from tests.test_train import _config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 8
# digits:smoke on the pico ViT, 8 steps of 16 (8 per process), a checkpoint every 2 steps,
# evaluated once at the end with 30-example eval batches (4 devices: read as 32, padded).
FLAGS = {
    "model.variant": "pico", "total_steps": STEPS, "checkpoint.every_steps": 2,
    "log_every_steps": 2, "eval_every_steps": 0, "eval_batch_size": 30,
    "tensorboard": False, "progress": True, "data_shards": 2,
}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_process_run(tfds_dir, tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("two_processes"))
    port = _free_port()
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    flags = [f"--config.{k}={v}" for k, v in FLAGS.items()]
    flags += [f"--config.dataset.data_dir={tfds_dir}", f"--workdir={workdir}"]
    flags += [f"--config.distributed.coordinator_address=localhost:{port}",
              "--config.distributed.num_processes=2"]  # fmt: skip
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rope_lie.main",
                "--config=configs/digits.py:smoke",
                *flags,
                f"--config.distributed.process_id={i}",
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-4000:]
    return workdir, outs


def _one_device_config(tfds_dir):
    config = _config(tfds_dir, **{k: v for k, v in FLAGS.items() if k != "progress"})
    config.progress = False
    return config


@pytest.fixture(scope="module")
def one_device_run(tfds_dir, tmp_path_factory):
    """The same run in this process, on its one device: (workdir, final metrics)."""
    workdir = str(tmp_path_factory.mktemp("one_device"))
    return workdir, train.train_and_evaluate(_one_device_config(tfds_dir), workdir)


def _assert_same_params(dir_a, dir_b, atol=2e-5):
    _, a_state = checkpoint.load_state(os.path.join(dir_a, "checkpoints"))
    _, b_state = checkpoint.load_state(os.path.join(dir_b, "checkpoints"))
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(a_state["params"]),
        jax.tree_util.tree_leaves_with_path(b_state["params"]),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, atol=atol, err_msg=jax.tree_util.keystr(path))


def test_two_processes_train_as_one(two_process_run, one_device_run):
    workdir, outs = two_process_run
    ref_dir, ref = one_device_run
    records = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    ref_records = metrics.read_jsonl(os.path.join(ref_dir, "metrics.jsonl"))
    assert [r["step"] for r in records] == [2, 4, 6, 8]  # written once, by process 0
    np.testing.assert_allclose(
        [r["loss"] for r in records], [r["loss"] for r in ref_records], rtol=1e-5
    )
    _assert_same_params(workdir, ref_dir)
    with open(os.path.join(workdir, "final.json")) as f:
        final = json.load(f)
    for name, res in ref["evals"].items():  # every test digit once, padding masked out
        assert final["evals"][name]["num_examples"] == res["num_examples"] == 360
        assert final["evals"][name]["accuracy"] == pytest.approx(res["accuracy"], abs=1 / 360)
    assert "mesh of 4 cpu devices in 2 processes" in outs[0]
    assert "eval " in outs[0] and "eval " not in outs[1]  # the table and the bar: process 0
    assert "step/s" in outs[0] or "s/step" in outs[0]
    assert "s/step" not in outs[1] and "step/s" not in outs[1]
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["6", "8"]  # one set


def _drop_last_checkpoint(workdir, copy_to):
    import shutil

    shutil.copytree(workdir, copy_to)
    shutil.rmtree(os.path.join(copy_to, "checkpoints", str(STEPS)))
    os.remove(os.path.join(copy_to, "final.json"))


def test_the_two_process_checkpoint_resumes_in_one_process(two_process_run, tfds_dir, tmp_path):
    """Restore on another topology: drop the last checkpoint of the 2-process job and let one
    process on one device redo steps 7-8 from step 6; it ends where the job ended."""
    workdir, _ = two_process_run
    resumed = str(tmp_path / "resumed")
    _drop_last_checkpoint(workdir, resumed)
    train.train_and_evaluate(_one_device_config(tfds_dir), resumed)
    step, _ = checkpoint.load_state(os.path.join(resumed, "checkpoints"))
    assert step == STEPS
    _assert_same_params(resumed, workdir)


def test_a_one_device_checkpoint_resumes_on_a_4_device_fsdp_mesh(
    one_device_run, tfds_dir, tmp_path
):
    """The other direction: a 1-device run's step-6 checkpoint resumes in a process with 4
    devices on a data=1 x fsdp=4 mesh (parameters sharded) and ends at the run's step 8."""
    ref_dir, _ = one_device_run
    resumed = str(tmp_path / "fsdp")
    _drop_last_checkpoint(ref_dir, resumed)
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    flags = [f"--config.{k}={v}" for k, v in FLAGS.items()]  # data_shards=2: the same batches
    flags += ["--config.mesh.data=1", "--config.mesh.fsdp=4", "--config.fsdp_min_size=256"]
    flags += [f"--config.dataset.data_dir={tfds_dir}", f"--workdir={resumed}"]
    # digits:smoke evaluates size8_shuffled too; the 1-device run (tests/test_train) does not.
    proc = subprocess.run(
        [sys.executable, "-m", "rope_lie.main", "--config=configs/digits.py:smoke", *flags],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Resuming from step 6" in proc.stdout + proc.stderr
    assert "data=1 x fsdp=4 mesh of 4 cpu devices" in proc.stdout + proc.stderr
    _assert_same_params(resumed, ref_dir)
