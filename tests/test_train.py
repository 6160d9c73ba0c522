"""End-to-end tests of rope_lie/train.py on sklearn digits (generated locally, no download)."""

import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from configs import digits
from rope_lie import checkpoint, job, metrics, run_inputs, train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(tfds_dir, **overrides):
    """digits:smoke with 12 steps, dropout on, a checkpoint every 4 steps, 2 evals, and the
    smallest ViT (pico: 2 layers of width 32): the loop is under test here, not the model."""
    config = digits.get_config("smoke")
    config.dataset.data_dir = tfds_dir
    config.model.variant = "pico"
    config.total_steps = 12
    config.checkpoint.every_steps = 4
    config.log_every_steps = 2
    config.eval_every_steps = 6
    del config.evals["size8_shuffled"]
    for key, value in overrides.items():
        target = config
        *parents, leaf = key.split(".")
        for p in parents:
            target = target[p]
        target[leaf] = value
    return config


@pytest.fixture(scope="module")
def reference(tfds_dir, tmp_path_factory):
    """An uninterrupted run: (workdir, returned metrics)."""
    workdir = str(tmp_path_factory.mktemp("reference"))
    return workdir, train.train_and_evaluate(_config(tfds_dir), workdir)


def test_run_writes_metrics_checkpoints_and_final(reference):
    workdir, final = reference
    assert final["step"] == 12
    assert set(final["evals"]) == {"size8", "size16"}
    for name, res in final["evals"].items():
        assert 0.0 <= res["accuracy"] <= 1.0 and np.isfinite(res["loss"]), (name, res)
        assert res["num_examples"] == 360  # every test digit once, padding masked out
        assert res["best_step"] in (6, 12)
    # The 16x16 evaluation runs the 8x8-trained model on a 2x larger token grid.
    assert final["evals"]["size16"]["resolution"] == "16x16"
    with open(os.path.join(workdir, "final.json")) as f:
        assert json.load(f) == json.loads(json.dumps(final))
    with np.load(os.path.join(workdir, metrics.EXAMPLES_FILE)) as examples:
        assert sorted(examples) == ["size16", "size8"]
        for name, correct in examples.items():
            assert correct.dtype == bool and correct.shape == (360,)
            assert correct.mean() == final["evals"][name]["accuracy"]
    records = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10, 12]
    assert all(k in records[0] for k in ("loss", "lr", "throughput", "grad_norm"))
    assert "size8/accuracy" in records[2] and "size8/accuracy" not in records[1]
    assert os.listdir(os.path.join(workdir, "tensorboard"))
    steps = sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")))
    assert steps == [8, 12]  # keep=2 latest of 4, 8, 12


def test_rerun_of_a_finished_run_only_reevaluates(reference, tfds_dir, monkeypatch, capsys):
    workdir, final = reference
    trims = []  # each evaluation hands its freed heap back (job.release_free_heap)
    monkeypatch.setattr(train.job, "release_free_heap", lambda: trims.append(1) or True)
    capsys.readouterr()
    again = train.train_and_evaluate(_config(tfds_dir, progress=True), workdir)
    out, err = capsys.readouterr()
    assert f"{workdir}: already at step 12; evaluating its final state" in out
    assert "eval size8" in err and "eval size16" in err  # the evaluation's own progress bars
    assert trims == [1]
    assert again["evals"]["size8"]["accuracy"] == final["evals"]["size8"]["accuracy"]
    assert len(metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))) == 6


def test_run_killed_in_its_final_evaluations_resumes_evaluating(
    reference, tfds_dir, tmp_path, monkeypatch, capsys
):
    """The last step is saved before its evaluations: a kill there costs no training steps."""
    workdir, final = str(tmp_path), reference[1]
    evals = train.loop.evals

    def killed_at_the_end(run, state, step):
        if step == run.total:
            raise KeyboardInterrupt("killed while evaluating")
        return evals(run, state, step)

    monkeypatch.setattr(train.loop, "evals", killed_at_the_end)
    with pytest.raises(KeyboardInterrupt):
        train.train_and_evaluate(_config(tfds_dir), workdir)
    monkeypatch.setattr(train.loop, "evals", evals)
    capsys.readouterr()
    again = train.train_and_evaluate(_config(tfds_dir), workdir)
    assert f"{workdir}: already at step 12; evaluating its final state" in capsys.readouterr().out
    for name, res in final["evals"].items():
        np.testing.assert_allclose(again["evals"][name]["accuracy"], res["accuracy"], atol=1e-6)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_release_free_heap_finds_glibcs_malloc_trim():
    assert job._malloc_trim() is not None
    assert job.release_free_heap() in (True, False)


# Training in a subprocess; after every checkpoint save it sleeps, so the parent can SIGKILL it
# mid-run, after the first checkpoint and before the last one.
_CHILD = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, sys.argv[1])
    from tests import test_train
    from rope_lie import train

    save = train.ckpt.save
    def slow_save(*args, **kwargs):
        out = save(*args, **kwargs)
        time.sleep(0.5)
        return out
    train.ckpt.save = slow_save
    train.train_and_evaluate(test_train._config(sys.argv[2]), sys.argv[3])
    """
)


def _child(tfds_dir, workdir):
    pythonpath = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=pythonpath)
    cmd = [sys.executable, "-c", _CHILD, REPO, tfds_dir, workdir]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_resume_after_kill_9_is_bit_identical(reference, tfds_dir, tmp_path, capsys):
    ref_dir, ref_final = reference
    workdir = str(tmp_path / "killed")
    proc = _child(tfds_dir, workdir)
    first = os.path.join(workdir, "checkpoints", "4")  # renamed into place once complete
    deadline = time.time() + 240
    while not os.path.isdir(first) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "training ended before it could be killed:\n" + proc.stdout.read()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))[-1]["step"]
    assert killed_at < 12

    # Only the killed run needs its own process; the rerun resumes here from what it left.
    capsys.readouterr()
    train.train_and_evaluate(_config(tfds_dir), workdir)
    assert "Resuming from step" in capsys.readouterr().out

    ref_step, ref_state = checkpoint.load_state(os.path.join(ref_dir, "checkpoints"))
    step, state = checkpoint.load_state(os.path.join(workdir, "checkpoints"))
    assert step == ref_step == 12
    ref_leaves = jax.tree_util.tree_leaves_with_path(ref_state)
    leaves = jax.tree_util.tree_leaves_with_path(state)
    assert [p for p, _ in leaves] == [p for p, _ in ref_leaves]
    for (path, ref), (_, value) in zip(ref_leaves, leaves, strict=True):
        np.testing.assert_array_equal(value, ref, err_msg=jax.tree_util.keystr(path))
    with open(os.path.join(workdir, "final.json")) as f:
        assert json.load(f) == json.loads(json.dumps(ref_final))
    drop = lambda r: {k: v for k, v in r.items() if k != "throughput"}
    ref_records = metrics.read_jsonl(os.path.join(ref_dir, "metrics.jsonl"))
    records = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    assert [drop(r) for r in records] == [drop(r) for r in ref_records]


@pytest.mark.parametrize("every_steps, saved", [(1, 1), (3, None)])
def test_nan_stops_naming_the_step_and_keeps_last_good_checkpoint(
    tfds_dir, tmp_path, every_steps, saved
):
    # lr = 1e38: the first update sends the weights to ~1e38, the next forward pass overflows.
    # Saving every 3 steps, step 2's metrics are read only after step 3 is dispatched (the loop
    # waits for a step's own metrics only where a log, evaluation or save needs them): the NaN
    # must still be named as step 2's, and step 3's state (NaN too) never saved.
    config = _config(
        tfds_dir,
        **{"optim.lr": 1e38, "optim.warmup_steps": 0, "checkpoint.every_steps": every_steps,
           "log_every_steps": 5},
    )  # fmt: skip
    config.checkpoint.async_save = False
    resume = (
        f"the latest checkpoint is step {saved}"
        if saved
        else "no checkpoint was saved before it (a rerun starts from step 0)"
    )
    with pytest.raises(FloatingPointError) as raised:
        train.train_and_evaluate(config, str(tmp_path))
    message = str(raised.value)
    assert "at step 2;" in message and resume in message and "step None" not in message
    assert "Likely cause: a learning rate too high" in message and "optim.lr=1e+38" in message
    assert os.listdir(tmp_path / "checkpoints") == ([] if saved is None else [str(saved)])
    with open(tmp_path / "final.json") as f:  # strict JSON: no bare NaN
        final = json.load(f, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert final["step"] == 2 and final["stopped"] == "non-finite"
    assert final["last_good_checkpoint"] == saved
    bad = final["non_finite"]["values"]
    assert set(bad) & {"metrics/loss", "metrics/grad_norm"}, final
    assert all(final["metrics"][k.split("/")[1]] is None for k in bad)


def test_final_json_is_strict_json_with_non_finite_values_as_null(tmp_path):
    metrics.write_final(str(tmp_path), 3, {"val": {"accuracy": 0.5, "loss": float("inf")}})
    text = (tmp_path / "final.json").read_text()
    final = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert final["evals"]["val"] == {"accuracy": 0.5, "loss": None}
    assert final["non_finite"]["values"] == {"evals/val/loss": "inf"}


def test_a_workdir_keeps_its_config_and_loads_back_as_the_trained_model(reference, tfds_dir):
    """config.json is the run's config; config.py returns it; rope_lie.load gives the model
    with the last checkpoint's parameters, which classifies the test digits as the run's final
    evaluation did."""
    import importlib.util

    import rope_lie
    from rope_lie import interop, loading
    from rope_lie.data import pipeline

    workdir, final = reference
    config = _config(tfds_dir)
    model, loaded = rope_lie.load(workdir)
    # (the rerun test above may have rewritten it with progress bars on)
    as_json = lambda c: {**json.loads(c.to_json_best_effort()), "progress": None}
    assert as_json(loaded) == as_json(config)
    spec = importlib.util.spec_from_file_location("workdir_recipe", f"{workdir}/config.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    assert as_json(recipe.get_config()) == as_json(config)
    assert interop.load is loading.load

    _, state = checkpoint.load_state(os.path.join(workdir, "checkpoints"))
    from flax import nnx

    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    name = checkpoint.path_name  # the model's keys are ints where the checkpoint's are strings
    flat = {name(p): v for p, v in jax.tree_util.tree_leaves_with_path(params)}
    saved = {name(p): v for p, v in jax.tree_util.tree_leaves_with_path(state["params"])}
    assert sorted(flat) == sorted(saved)
    for key, value in saved.items():
        np.testing.assert_array_equal(np.asarray(flat[key]), value, err_msg=key)
    batches = pipeline.make_eval_iterator(loaded.dataset, batch_size=120, split=None)
    correct = [
        (np.argmax(model(b["image"]), -1) == b["label"])[b["mask"].astype(bool)] for b in batches
    ]
    accuracy = np.concatenate(correct).mean()
    np.testing.assert_allclose(accuracy, final["evals"]["size8"]["accuracy"], atol=1.5 / 360)


def test_sigterm_saves_the_step_and_exits_cleanly_then_resumes_exactly(
    reference, tfds_dir, tmp_path
):
    """A scheduler's SIGTERM mid-run: the child checkpoints the step it is on, exits with
    status 0 and no final.json; the rerun ends bit-identical to the uninterrupted run."""
    ref_dir, _ = reference
    workdir = str(tmp_path / "preempted")
    proc = _child(tfds_dir, workdir)
    first = os.path.join(workdir, "checkpoints", "4")
    deadline = time.time() + 240
    while not os.path.isdir(first) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "training ended before the signal:\n" + proc.stdout.read()
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert "Preemption at step" in out and not os.path.exists(os.path.join(workdir, "final.json"))
    stopped_at = int(re.search(r"Preemption at step (\d+)", out).group(1))
    step, _ = checkpoint.load_state(os.path.join(workdir, "checkpoints"))
    assert step == stopped_at and 4 <= step < 12  # the step it stopped on is saved

    train.train_and_evaluate(_config(tfds_dir), workdir)
    _, ref_state = checkpoint.load_state(os.path.join(ref_dir, "checkpoints"))
    _, state = checkpoint.load_state(os.path.join(workdir, "checkpoints"))
    for (path, ref), (_, value) in zip(
        jax.tree_util.tree_leaves_with_path(ref_state),
        jax.tree_util.tree_leaves_with_path(state),
        strict=True,
    ):
        np.testing.assert_array_equal(value, ref, err_msg=jax.tree_util.keystr(path))


# The command line in a subprocess, with the same slow saves as _CHILD.
_MAIN_CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from rope_lie import main, train

    save = train.ckpt.save
    def slow_save(*args, **kwargs):
        out = save(*args, **kwargs)
        time.sleep(0.5)
        return out
    train.ckpt.save = slow_save
    sys.exit(main.run(["rope_lie.main", *sys.argv[2:]]))
    """
)


def test_ctrl_c_saves_the_step_says_so_and_exits_130(tfds_dir, tmp_path):
    """Ctrl-C (SIGINT) mid-run through the command line: the step it is on is checkpointed, the
    run says so and exits with status 130, without a traceback."""
    workdir = str(tmp_path / "interrupted")
    args = [
        "--config=configs/digits.py:smoke,variant=pico",
        "--config.total_steps=12",
        "--config.checkpoint.every_steps=4",
        f"--config.dataset.data_dir={tfds_dir}",
        f"--workdir={workdir}",
    ]
    pythonpath = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", _MAIN_CHILD, REPO, *args],
        env=dict(os.environ, PYTHONPATH=pythonpath),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    first = os.path.join(workdir, "checkpoints", "4")
    deadline = time.time() + 240
    while not os.path.isdir(first) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "training ended before the signal:\n" + proc.stdout.read()
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, out
    assert "Ctrl-C: saving a checkpoint at the next step" in out and "Traceback" not in out
    stopped_at = int(re.search(r"Interrupted \(Ctrl-C\) at step (\d+)", out).group(1))
    step, _ = checkpoint.load_state(os.path.join(workdir, "checkpoints"))
    assert step == stopped_at and 4 <= step < 12, out
    assert not os.path.exists(os.path.join(workdir, "final.json"))


def test_a_second_ctrl_c_stops_at_once():
    import threading

    with job.StopOnSigterm() as stop:
        if threading.current_thread() is threading.main_thread():
            assert signal.getsignal(signal.SIGINT) == stop._handle
        stop._handle(signal.SIGINT, None)
        assert stop.requested and stop.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            stop._handle(signal.SIGINT, None)
    assert signal.getsignal(signal.SIGINT) != stop._handle


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax, closed loop
def test_a_truncated_newest_checkpoint_is_named_and_the_run_goes_on_from_the_one_before(
    reference, tfds_dir, tmp_path, capsys
):
    """The finished run's step-12 checkpoint loses the second half of its largest file: the
    rerun names the step and its directory, resumes from step 8 and ends as the reference (one
    evaluation of the two, to save time)."""
    ref_dir, ref_final = reference
    workdir = str(tmp_path / "damaged")
    shutil.copytree(ref_dir, workdir)
    os.remove(os.path.join(workdir, "final.json"))
    step_dir = os.path.join(workdir, "checkpoints", "12")
    largest = max(
        (os.path.join(d, f) for d, _, names in os.walk(step_dir) for f in names),
        key=os.path.getsize,
    )
    with open(largest, "r+b") as f:
        f.truncate(os.path.getsize(largest) // 2)
    config = _config(tfds_dir)
    del config.evals["size16"]
    capsys.readouterr()
    final = train.train_and_evaluate(config, workdir)
    out = capsys.readouterr().out
    assert f"Checkpoint step 12 in {workdir}/checkpoints cannot be read: " in out
    assert "Falling back to checkpoint step 8" in out and "Resuming from step 8 of 12" in out
    assert final["evals"]["size8"] == json.loads(json.dumps(ref_final["evals"]["size8"]))
    _, ref_state = checkpoint.load_state(os.path.join(ref_dir, "checkpoints"))
    step, state = checkpoint.load_state(os.path.join(workdir, "checkpoints"))
    assert step == 12
    for (path, ref), (_, value) in zip(
        jax.tree_util.tree_leaves_with_path(ref_state),
        jax.tree_util.tree_leaves_with_path(state),
        strict=True,
    ):
        np.testing.assert_array_equal(value, ref, err_msg=jax.tree_util.keystr(path))
    assert os.listdir(os.path.join(workdir, "checkpoints-unreadable")) == ["12"]


def test_a_checkpoint_of_another_config_is_named_before_training(reference, tfds_dir):
    """The workdir holds another model's checkpoint: the error names the step and the first
    parameter that differs (not orbax's dump of both trees), and nothing is trained or written."""
    ref_dir, _ = reference
    before = os.listdir(os.path.join(ref_dir, "checkpoints"))
    match = (
        r"checkpoint at step 12 in .* another configuration: parameter blocks/0/attn/bk_NH has "
        r"shape \(2, 16\) in the checkpoint and \(4, 16\) in this config"
    )
    with pytest.raises(ValueError, match=match):
        train.train_and_evaluate(_config(tfds_dir, **{"model.variant": "mu"}), ref_dir)
    assert os.listdir(os.path.join(ref_dir, "checkpoints")) == before


def _make_read_only(path):
    """chmod 500, or skip where this process writes there anyway (root with CAP_DAC_OVERRIDE;
    _under_a_file covers root)."""
    os.makedirs(path, exist_ok=True)
    os.chmod(path, 0o500)
    try:
        open(os.path.join(path, "probe"), "w").close()
    except PermissionError:
        return
    pytest.skip("this process writes in read-only directories (root)")


def _read_only_dir(tmp_path):
    _make_read_only(tmp_path / "workdir")
    return str(tmp_path / "workdir"), str(tmp_path / "workdir")


def _under_a_file(tmp_path):  # unwritable for root too
    (tmp_path / "a_file").write_text("")
    return str(tmp_path / "a_file" / "workdir"), str(tmp_path / "a_file" / "workdir")


def _read_only_checkpoints(tmp_path):
    _make_read_only(tmp_path / "checkpoints")
    return str(tmp_path), str(tmp_path / "checkpoints")


@pytest.mark.parametrize("make", [_read_only_dir, _under_a_file, _read_only_checkpoints])
def test_an_unwritable_workdir_fails_before_reading_data(tfds_dir, tmp_path, monkeypatch, make):
    workdir, unwritable = make(tmp_path)

    def prepare_data(config):
        raise AssertionError("data prepared before the workdir was checked")

    monkeypatch.setattr(run_inputs, "prepare_data", prepare_data)
    with pytest.raises(OSError, match=f"cannot write in '{re.escape(unwritable)}'"):
        train.train_and_evaluate(_config(tfds_dir), workdir)
