"""What several test files share: the repository root, a subprocess's environment, the
reference run's config, and comparisons of checkpoints.

The reference run itself (``reference_run`` in conftest.py) is trained once per test process
with ``digits_config``; the tests that resume, interrupt, damage or re-evaluate a run, in one
process or several, compare against it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import jax
import numpy as np

from rope_lie import checkpoint, metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def subprocess_env(devices: int | None = None) -> dict[str, str]:
    """This environment for a child process: the repository importable (``tests``, ``configs``)
    and, with ``devices``, that many simulated CPU devices."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    if devices is not None:
        flag = f"--xla_force_host_platform_device_count={devices}"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
    return env


# The reference run: digits:smoke on the smallest ViT (pico: 2 layers of width 32; the loop is
# under test, not the model), 12 steps of 16 in 2 data shards (so that 2 processes read the
# same batches), a checkpoint every 4 steps (keep=2: 8 and 12 remain), evaluated at steps 6
# and 12 on the 8x8 and 16x16 digits in batches of 30 (padded to 32 on 4 devices), with
# dropout on.
REFERENCE = {
    "model.variant": "pico",
    "total_steps": 12,
    "checkpoint.every_steps": 4,
    "log_every_steps": 2,
    "eval_every_steps": 6,
    "eval_batch_size": 30,
    "data_shards": 2,
}


def digits_config(tfds_dir: str, **overrides):
    """The reference run's config (``REFERENCE``), with ``overrides`` ("optim.lr": 0.1, ...)."""
    from configs import digits

    config = digits.get_config("smoke")
    config.dataset.data_dir = tfds_dir
    del config.evals["size8_shuffled"]
    config.update_from_flattened_dict({**REFERENCE, **overrides})
    return config


def reference_flags(tfds_dir: str) -> list[str]:
    """The reference run's config as ``rope_lie.main`` flags (its size8_shuffled evaluation,
    which flags cannot remove, aside)."""
    flags = ["--config=configs/digits.py:smoke", f"--config.dataset.data_dir={tfds_dir}"]
    return flags + [f"--config.{k}={v}" for k, v in REFERENCE.items()]


def wait_for_checkpoint(proc: subprocess.Popen, workdir: str, step: int, timeout: float = 240):
    """Wait until ``workdir`` holds the complete checkpoint of ``step`` (renamed into place
    once written) while ``proc`` still runs."""
    path = os.path.join(workdir, "checkpoints", str(step))
    deadline = time.time() + timeout
    while not os.path.isdir(path) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, f"the run ended before step {step}'s checkpoint:\n" + (
        proc.stdout.read() if proc.stdout else ""
    )
    assert os.path.isdir(path), f"no checkpoint of step {step} after {timeout} s"


def assert_same_checkpoints(dir_a: str, dir_b: str, *, params_only: bool = False, atol=0.0):
    """The latest checkpoints of two workdirs hold the same step and the same state: bit for
    bit (``atol=0``), or to ``atol``; ``params_only``: the parameters alone."""
    step_a, state_a = checkpoint.load_state(os.path.join(dir_a, "checkpoints"))
    step_b, state_b = checkpoint.load_state(os.path.join(dir_b, "checkpoints"))
    assert step_a == step_b
    if params_only:
        state_a, state_b = state_a["params"], state_b["params"]
    leaves_a = jax.tree_util.tree_leaves_with_path(state_a)
    leaves_b = jax.tree_util.tree_leaves_with_path(state_b)
    assert [p for p, _ in leaves_a] == [p for p, _ in leaves_b]
    for (path, a), (_, b) in zip(leaves_a, leaves_b, strict=True):
        if atol:
            np.testing.assert_allclose(a, b, atol=atol, err_msg=jax.tree_util.keystr(path))
        else:
            np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def assert_same_records(path: str, reference_path: str) -> None:
    """Two metrics.jsonl hold records of the same steps and fields, their numbers equal to
    float tolerance (the throughput aside: a wall-clock number)."""
    records, expected = metrics.read_jsonl(path), metrics.read_jsonl(reference_path)
    steps, expected_steps = [r["step"] for r in records], [r["step"] for r in expected]
    assert steps == expected_steps, f"{path}: steps {steps}, expected {expected_steps}"
    for got, want in zip(records, expected, strict=True):
        assert list(got) == list(want), f"step {got['step']}: {list(got)} != {list(want)}"
        for key in set(want) - {"throughput"}:
            if isinstance(want[key], float):
                np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-9, err_msg=key)
            else:
                assert got[key] == want[key], (got["step"], key)


def copy_without_last_checkpoint(workdir: str, copy_to: str) -> int:
    """A copy of a finished run's workdir without its last checkpoint and final.json (a rerun
    resumes from the checkpoint before); returns the step it resumes from."""
    shutil.copytree(workdir, copy_to)
    root = os.path.join(copy_to, "checkpoints")
    steps = sorted(int(s) for s in os.listdir(root))
    shutil.rmtree(os.path.join(root, str(steps[-1])))
    os.remove(os.path.join(copy_to, "final.json"))
    return steps[-2]
