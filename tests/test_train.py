"""End-to-end tests of rope_lie/train.py on sklearn digits (generated locally, no download).

Most tests start from the session's reference run (``reference_run`` in conftest.py,
``helpers.digits_config``): they resume, re-evaluate, interrupt or damage a copy of it.
"""

import json
import os
import pathlib
import platform
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from rope_lie import checkpoint, errors, job, main, metrics, run_inputs, train
from rope_lie import config_lib as common
from tests import helpers
from tests.helpers import digits_config


@pytest.fixture
def reference(reference_run):
    return reference_run


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


def test_final_only_evals_wait_for_the_end_and_data_seed_equal_to_seed_changes_nothing(
    reference, tfds_dir, tmp_path
):
    """size16 marked final_only: the evaluation at step 6 skips it, the last one has it. The
    run sets data_seed = seed (0), which must train on the same batches as the reference (no
    data_seed): the same losses and accuracies; an evaluation changes no training number."""
    config = digits_config(tfds_dir, data_seed=0)
    config.evals.size16.final_only = True
    final = train.train_and_evaluate(config, str(tmp_path))
    records = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert "size8/accuracy" in records[2] and "size16/accuracy" not in records[2]
    assert {"size8/accuracy", "size16/accuracy"} <= set(records[-1])
    expected = metrics.read_jsonl(os.path.join(reference[0], "metrics.jsonl"))
    for key in ("loss", "train_accuracy", "grad_norm"):
        np.testing.assert_allclose(
            [r[key] for r in records], [r[key] for r in expected], rtol=1e-6, err_msg=key
        )
    for name, res in reference[1]["evals"].items():
        assert final["evals"][name]["accuracy"] == pytest.approx(res["accuracy"], abs=1e-9)


def test_rerun_of_a_finished_run_only_reevaluates(
    reference, tfds_dir, tmp_path, monkeypatch, capsys
):
    ref_dir, final = reference
    workdir = str(tmp_path / "finished")
    shutil.copytree(ref_dir, workdir)
    trims = []  # each evaluation hands its freed heap back (job.release_free_heap)
    monkeypatch.setattr(train.job, "release_free_heap", lambda: trims.append(1) or True)
    capsys.readouterr()
    again = train.train_and_evaluate(digits_config(tfds_dir, progress=True), workdir)
    out, err = capsys.readouterr()
    assert f"{workdir}: already at step 12; evaluating its final state" in out
    assert "eval size8" in err and "eval size16" in err  # the evaluation's own progress bars
    assert trims == [1]
    assert again["evals"]["size8"]["accuracy"] == final["evals"]["size8"]["accuracy"]
    assert len(metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))) == 6


def test_run_killed_in_its_final_evaluations_resumes_evaluating(
    reference, tfds_dir, tmp_path, monkeypatch, capsys
):
    """The last step is saved before its evaluations: a kill there costs no training steps.
    (From the reference's step-8 checkpoint: steps 9-12, then the kill.) The killed run wrote
    no step-12 record; the rerun writes it, its training scalars from the step-12 checkpoint:
    metrics.jsonl ends as the uninterrupted run's (throughput aside, a wall-clock number)."""
    workdir, final = str(tmp_path / "killed"), reference[1]
    helpers.copy_without_last_checkpoint(reference[0], workdir)
    evals = train.loop.evals

    def killed_at_the_end(run, state, step, final=True):
        if step == run.total:
            raise KeyboardInterrupt("killed while evaluating")
        return evals(run, state, step, final)

    monkeypatch.setattr(train.loop, "evals", killed_at_the_end)
    with pytest.raises(KeyboardInterrupt):
        train.train_and_evaluate(digits_config(tfds_dir), workdir)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["12", "8"]
    jsonl = os.path.join(workdir, "metrics.jsonl")
    assert [r["step"] for r in metrics.read_jsonl(jsonl)] == [2, 4, 6, 8, 10]
    monkeypatch.setattr(train.loop, "evals", evals)
    capsys.readouterr()
    again = train.train_and_evaluate(digits_config(tfds_dir), workdir)
    assert f"{workdir}: already at step 12; evaluating its final state" in capsys.readouterr().out
    for name, res in final["evals"].items():
        np.testing.assert_allclose(again["evals"][name]["accuracy"], res["accuracy"], atol=1e-6)
    helpers.assert_same_records(jsonl, os.path.join(reference[0], "metrics.jsonl"))
    # Rerun once more (a kill after the step-12 record, before final.json): no second record.
    train.train_and_evaluate(digits_config(tfds_dir), workdir)
    helpers.assert_same_records(jsonl, os.path.join(reference[0], "metrics.jsonl"))


def test_release_free_heap_calls_malloc_trim_where_the_c_library_has_it(monkeypatch):
    """glibc's malloc_trim is found; release_free_heap calls it with pad 0 and says whether it
    released memory; without it (another C library) it does nothing and says False."""
    if platform.libc_ver()[0] == "glibc":
        assert job._malloc_trim() is not None
    calls = []
    monkeypatch.setattr(job, "_malloc_trim", lambda: lambda pad: calls.append(pad) or 1)
    assert job.release_free_heap() is True and calls == [0]
    monkeypatch.setattr(job, "_malloc_trim", lambda: lambda pad: 0)
    assert job.release_free_heap() is False
    monkeypatch.setattr(job, "_malloc_trim", lambda: None)
    assert job.release_free_heap() is False


# Training in a subprocess; after every checkpoint save it sleeps, so the parent can SIGKILL it
# mid-run, after the first checkpoint and before the last one.
_CHILD = textwrap.dedent(
    """
    import sys, time
    from rope_lie import checkpoint, train
    from tests.helpers import digits_config

    save = checkpoint.save
    def slow_save(*args, **kwargs):
        out = save(*args, **kwargs)
        time.sleep(0.5)
        return out
    checkpoint.save = slow_save
    train.train_and_evaluate(digits_config(sys.argv[1]), sys.argv[2])
    """
)


def test_resume_after_kill_9_is_bit_identical(reference, tfds_dir, tmp_path, capsys):
    ref_dir, ref_final = reference
    workdir = str(tmp_path / "killed")
    with subprocess.Popen(
        [sys.executable, "-c", _CHILD, tfds_dir, workdir],
        env=helpers.subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        helpers.wait_for_checkpoint(proc, workdir, 4)
        proc.send_signal(signal.SIGKILL)
    killed_at = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))[-1]["step"]
    assert killed_at < 12

    # Only the killed run needs its own process; the rerun resumes here from what it left.
    capsys.readouterr()
    train.train_and_evaluate(digits_config(tfds_dir), workdir)
    assert "Resuming from step" in capsys.readouterr().out
    helpers.assert_same_checkpoints(workdir, ref_dir)
    with open(os.path.join(workdir, "final.json")) as f:
        assert json.load(f) == json.loads(json.dumps(ref_final))
    drop = lambda r: {k: v for k, v in r.items() if k != "throughput"}
    ref_records = metrics.read_jsonl(os.path.join(ref_dir, "metrics.jsonl"))
    records = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    assert [drop(r) for r in records] == [drop(r) for r in ref_records]


def test_a_carried_run_resumes_to_the_uninterrupted_end(reference, tfds_dir, tmp_path):
    """A run stopped at step 8 (its step-12 checkpoint, final.json and examples gone), packed
    with ``experiments/studies/carry.py``, removed, and put back as on another machine: the
    rerun resumes from step 8 and ends bit-identical to the uninterrupted run."""
    from experiments.studies import carry

    workdir = str(tmp_path / "machine_a" / "run")
    shutil.copytree(reference[0], workdir)
    for name in ("final.json", metrics.EXAMPLES_FILE):
        os.remove(os.path.join(workdir, name))
    shutil.rmtree(os.path.join(workdir, "checkpoints", "12"))
    assert carry.pack(workdir, str(tmp_path / "study"))[1] == 8
    shutil.rmtree(tmp_path / "machine_a")
    runs = str(tmp_path / "machine_b")
    [carried] = carry.unpack(str(tmp_path / "study"), runs, log=lambda _: None)
    assert os.listdir(os.path.join(carried, "checkpoints")) == ["8"]
    train.train_and_evaluate(digits_config(tfds_dir), carried)
    helpers.assert_same_checkpoints(carried, reference[0])
    with open(os.path.join(carried, "final.json")) as f:
        assert json.load(f) == json.loads(json.dumps(reference[1]))


def _signal_after_saving(monkeypatch, signum, step):
    """Send this process ``signum`` right after the checkpoint of ``step`` is saved, as a
    scheduler (SIGTERM) or a user (Ctrl-C, SIGINT) would while the run goes on."""
    save = checkpoint.save

    def save_then_signal(manager, saved_step, *args, **kwargs):
        out = save(manager, saved_step, *args, **kwargs)
        if saved_step == step:
            os.kill(os.getpid(), signum)
        return out

    monkeypatch.setattr(checkpoint, "save", save_then_signal)


def test_sigterm_saves_the_next_step_exits_0_then_resumes_exactly(
    reference, tfds_dir, tmp_path, monkeypatch, capsys
):
    """A scheduler's SIGTERM mid-run (``rope_lie.main``'s run): the step it is on is
    checkpointed, the run stops with status 0 and no final.json; the rerun ends bit-identical
    to the uninterrupted run."""
    workdir = str(tmp_path / "preempted")
    _signal_after_saving(monkeypatch, signal.SIGTERM, 4)
    assert main._train(digits_config(tfds_dir), workdir) == 0
    out = capsys.readouterr().out
    stopped_at = int(re.search(r"Preemption at step (\d+)", out).group(1))
    assert stopped_at == 5 and not os.path.exists(os.path.join(workdir, "final.json"))
    assert checkpoint.load_state(os.path.join(workdir, "checkpoints"))[0] == stopped_at
    monkeypatch.undo()
    train.train_and_evaluate(digits_config(tfds_dir), workdir)
    helpers.assert_same_checkpoints(workdir, reference[0])


def test_ctrl_c_saves_the_next_step_says_so_and_exits_130(tfds_dir, tmp_path, monkeypatch, capsys):
    """Ctrl-C (SIGINT) mid-run: the step it is on is checkpointed and the run says so and
    stops; ``rope_lie.main`` exits with status 130."""
    workdir = str(tmp_path / "interrupted")
    _signal_after_saving(monkeypatch, signal.SIGINT, 4)
    assert main._train(digits_config(tfds_dir), workdir) == main.EXIT_INTERRUPTED == 130
    out = capsys.readouterr().out
    assert "Ctrl-C: saving a checkpoint at the next step" in out
    stopped_at = int(re.search(r"Interrupted \(Ctrl-C\) at step (\d+)", out).group(1))
    assert stopped_at == 5 and not os.path.exists(os.path.join(workdir, "final.json"))
    assert checkpoint.load_state(os.path.join(workdir, "checkpoints"))[0] == stopped_at


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


@pytest.mark.parametrize("every_steps, saved", [(1, 1), (3, None)])
def test_nan_stops_naming_the_step_and_keeps_last_good_checkpoint(
    tfds_dir, tmp_path, every_steps, saved
):
    # lr = 1e38: the first update sends the weights to ~1e38, the next forward pass overflows.
    # Saving every 3 steps, step 2's metrics are read only after step 3 is dispatched (the loop
    # waits for a step's own metrics only where a log, evaluation or save needs them): the NaN
    # must still be named as step 2's, and step 3's state (NaN too) never saved.
    config = digits_config(
        tfds_dir,
        **{
            "optim.lr": 1e38,
            "optim.warmup_steps": 0,
            "checkpoint.every_steps": every_steps,
            "log_every_steps": 5,
        },
    )
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
    config = digits_config(tfds_dir)
    model, loaded = rope_lie.load(workdir)
    as_json = lambda c: json.loads(c.to_json_best_effort())
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
    config = digits_config(tfds_dir)
    del config.evals["size16"]
    capsys.readouterr()
    final = train.train_and_evaluate(config, workdir)
    out = capsys.readouterr().out
    assert f"Checkpoint step 12 in {workdir}/checkpoints cannot be read: " in out
    assert "Falling back to checkpoint step 8" in out and "Resuming from step 8 of 12" in out
    assert final["evals"]["size8"] == json.loads(json.dumps(ref_final["evals"]["size8"]))
    helpers.assert_same_checkpoints(workdir, ref_dir)
    assert os.listdir(os.path.join(workdir, "checkpoints-unreadable")) == ["12"]


def test_a_checkpoint_of_another_config_is_named_before_training(reference, tfds_dir, tmp_path):
    """The workdir holds another config's checkpoint: the error names the first field that
    differs from its config.json; without one (a run of an older rope_lie), the first parameter
    that differs (not orbax's dump of both trees). Nothing is trained or written."""
    ref_dir, _ = reference
    before = os.listdir(os.path.join(ref_dir, "checkpoints"))
    other = digits_config(tfds_dir, **{"model.variant": "mu"})
    with pytest.raises(ValueError, match=r"holds a checkpoint of another config: model.variant="):
        train.train_and_evaluate(other, ref_dir)
    assert os.listdir(os.path.join(ref_dir, "checkpoints")) == before
    bare = str(tmp_path / "bare")
    shutil.copytree(ref_dir, bare)
    os.remove(os.path.join(bare, "config.json"))
    match = (
        r"checkpoint at step 12 in .* another configuration: parameter blocks/0/attn/bk_NH has "
        r"shape \(2, 16\) in the checkpoint and \(4, 16\) in this config"
    )
    with pytest.raises(ValueError, match=match):
        train.train_and_evaluate(other, bare)


def test_a_checkpoint_resumes_only_under_its_config_but_for_what_steps_do_not_read(tmp_path):
    """A seed, batch size or encoder of another run would be trained on top of this one's
    steps, and config.json rewritten as if the whole run had used them: refused. Evaluations,
    logging, saving, the data's path and the run's length may change."""
    from configs import quickstart
    from rope_lie import run_config

    workdir = str(tmp_path / "run")
    os.makedirs(workdir)
    run_config.write(workdir, quickstart.get_config("smoke"))
    run_config.check_resume(workdir, quickstart.get_config("smoke,pe=ape"))  # no checkpoint yet
    os.makedirs(os.path.join(workdir, "checkpoints", "8"))
    for field, value, said in [
        ("seed", 7, "seed=0 there, 7 here"),
        ("batch_size", 8, "batch_size=16 there, 8 here"),
        ("optim.lr", 0.5, "optim.lr="),
        ("data_shards", 2, "data_shards=0 there, 2 here"),  # other batches from the next step
    ]:
        changed = quickstart.get_config("smoke")
        *parents, leaf = field.split(".")
        node = changed
        for part in parents:
            node = node[part]
        node[leaf] = value
        with pytest.raises(ValueError, match=said):
            run_config.check_resume(workdir, changed)
    with pytest.raises(
        ValueError, match="model.additive='none' there, 'ape' here .and 3 more: model.pe, "
    ):
        run_config.check_resume(workdir, quickstart.get_config("smoke,pe=ape"))
    free = quickstart.get_config("smoke")
    free.total_steps, free.eval_batch_size, free.log_every_steps = 20, 4, 1
    free.checkpoint.every_steps, free.dataset.data_dir = 5, "/elsewhere"
    run_config.check_resume(workdir, free)


def test_an_option_one_config_has_and_the_other_lacks_is_a_difference(tmp_path):
    """A family's init argument, the position hook's rescaling or NaFlex, set in one run and
    not the other, changes the model or its data: refused both ways. A field a newer rope_lie
    added resumes at its default and is refused set otherwise; one it removed is not compared."""
    from configs import fashion_mnist
    from rope_lie import run_config

    def saved(arg, edit=None):
        workdir = str(tmp_path / f"run{len(os.listdir(tmp_path))}")
        os.makedirs(workdir)
        run_config.write(workdir, fashion_mnist.get_config(arg))
        if edit:
            path = os.path.join(workdir, run_config.CONFIG_JSON)
            with open(path) as f:
                config = json.load(f)
            edit(config)
            with open(path, "w") as f:
                json.dump(config, f)
        os.makedirs(os.path.join(workdir, "checkpoints", "8"))
        return workdir

    for there, here, said in [
        ("pe=rope_mixed,rotary_fraction=0.75", "pe=rope_mixed", "pe_hparams.rotary_fraction=0.75"),
        ("pe=rope_mixed", "pe=rope_mixed,rotary_fraction=0.75", "rotary_fraction=.absent. there"),
        ("pe=liere,rescale=2", "pe=liere", "position_augment.rescale=2.0 there, .absent. here"),
        ("pe=liere", "pe=liere,rescale=2", "position_augment.rescale=.absent. there, 2.0 here"),
        ("pe=liere,naflex", "pe=liere", "naflex.max_side=9 there"),
    ]:
        with pytest.raises(ValueError, match=said):
            run_config.check_resume(saved(there), fashion_mnist.get_config(here))
    run_config.check_resume(
        saved("pe=liere,rescale=2"), fashion_mnist.get_config("pe=liere,rescale=2")
    )

    older = saved("pe=liere", edit=lambda c: c.pop("data_seed"))  # written before data_seed
    run_config.check_resume(older, fashion_mnist.get_config("pe=liere"))
    seeded = fashion_mnist.get_config("pe=liere")
    seeded.data_seed = 3
    with pytest.raises(ValueError, match="data_seed=.absent. there, 3 here"):
        run_config.check_resume(older, seeded)
    removed = saved("pe=liere", edit=lambda c: c["model"].update(retired_field=1))
    run_config.check_resume(removed, fashion_mnist.get_config("pe=liere"))
    # written before position_augment and position_hparams existed: absent is off, as today's
    # None and {} are
    before = saved(
        "pe=liere",
        edit=lambda c: [c["model"].pop(k) for k in ("position_augment", "position_hparams")],
    )
    run_config.check_resume(before, fashion_mnist.get_config("pe=liere"))
    with pytest.raises(ValueError, match="position_augment.rescale=.absent. there, 2.0 here"):
        run_config.check_resume(before, fashion_mnist.get_config("pe=liere,rescale=2"))
    # an option off as {} in one and None in the other is off in both
    empty = saved("pe=liere", edit=lambda c: c["model"].update(position_augment={}))
    run_config.check_resume(empty, fashion_mnist.get_config("pe=liere"))


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
        train.train_and_evaluate(digits_config(tfds_dir), workdir)


def test_an_extrapolation_tool_the_model_lacks_fails_before_the_workdir_is_made(tfds_dir, tmp_path):
    """evals.<name>.extrapolation is checked against the model first: NTK needs a fixed
    spectrum, and digits' LieRE has learned generators."""
    config = digits_config(tfds_dir)
    config.evals["size16_ntk"] = common.eval_entry(image_size=16, extrapolation="ntk")
    workdir = str(tmp_path / "never")
    with pytest.raises(ValueError, match="evals.size16_ntk.extrapolation='ntk'.*supports") as e:
        train.train_and_evaluate(config, workdir)
    assert errors.is_user_error(e.value) and not os.path.exists(workdir)


def test_a_model_field_the_vit_does_not_take_is_named_before_the_workdir_is_made(
    tfds_dir, tmp_path
):
    """A config.model field that is no ViT argument (a newer rope_lie's, or misspelt) is named,
    with the closest argument, as the user's error, before the workdir exists."""
    workdir = str(tmp_path / "run")
    config = digits_config(tfds_dir)
    config.model.pe_hparam = {"block_size": 2}
    config.model.rotary_mode = "interleaved"
    with pytest.raises(ValueError) as raised:
        train.train_and_evaluate(config, workdir)
    assert str(raised.value).startswith(
        "config.model has ['pe_hparam', 'rotary_mode'], which this rope_lie's ViT does not take"
    )
    assert str(raised.value).endswith("; pe_hparam: did you mean 'pe_hparams'?")
    assert errors.is_user_error(raised.value)
    assert not os.path.exists(workdir)


def test_initialisation_compiles_without_backend_optimisation_only_for_cpu_programs():
    # Decided by the platform of the mesh the program runs on, not by the default backend: the
    # device queue builds ViT-B states with the CPU on a GPU machine.
    seen = []

    class Jitted:
        def lower(self, *args):
            return self

        def compile(self, compiler_options):
            seen.append(compiler_options)
            return lambda *args: args

    for device_platform in ("cpu", "gpu", "tpu"):
        assert train._run_once(Jitted(), device_platform)(7) == (7,)
    assert seen == [{"xla_backend_optimization_level": 0}, {}, {}]


def test_a_checkpoint_resumes_only_on_batches_made_as_before(reference):
    """Each checkpoint says how many shards its batches were made of (the reference run sets
    data_shards=2). data_shards=0 makes one per process: a resume of such a run by another
    process count would read other batches from the next step on, and is refused."""
    import json

    from rope_lie import config_lib

    workdir, _ = reference
    with open(os.path.join(workdir, "checkpoints", "12", "meta", "metadata")) as f:
        assert json.load(f)["data_shards"] == 2
    config = config_lib.base_config()  # data_shards=0, one process here
    train._check_data_shards({"data_shards": 1}, config, workdir)
    train._check_data_shards({}, config, workdir)  # written before the count was saved
    with pytest.raises(
        ValueError,
        match=r"batches of 2 data shards, this job makes 1 .*"
        r"--config.data_shards=2",
    ):
        train._check_data_shards({"data_shards": 2}, config, workdir)


def test_a_resume_refused_for_its_data_shards_writes_nothing(reference, tmp_path):
    """The data-shard check comes before config.json is rewritten, as the model check does."""
    from rope_lie import run_config

    workdir = str(tmp_path / "shards")
    shutil.copytree(reference[0], workdir)
    for step in ("8", "12"):
        meta = os.path.join(workdir, "checkpoints", step, "meta", "metadata")
        with open(meta) as f:
            saved = json.load(f)
        with open(meta, "w") as f:
            json.dump({**saved, "data_shards": 3}, f)
    path = os.path.join(workdir, run_config.CONFIG_JSON)
    before = os.stat(path).st_mtime_ns
    resumed = run_config.recipe_config(os.path.join(workdir, run_config.CONFIG_PY))
    with pytest.raises(ValueError, match=r"batches of 3 data shards, this job makes 2"):
        train.train_and_evaluate(resumed, workdir)
    assert os.stat(path).st_mtime_ns == before


def test_a_checkpoint_refuses_a_model_edited_in_config_json_that_keeps_the_shapes(
    reference, tfds_dir, tmp_path
):
    """Each checkpoint's meta records config.model. The workdir's config.json edited in fields
    that keep every parameter's shape (the LayerNorm epsilon, the position convention): a
    resume through its config.py (which check_resume compares with that same file) and
    rope_lie.load refuse it, naming the fields with both values; nothing is written."""
    import rope_lie
    from rope_lie import run_config

    ref_dir, _ = reference
    with open(os.path.join(ref_dir, "checkpoints", "12", "meta", "metadata")) as f:
        assert json.load(f)["model"] == run_config.model_record(digits_config(tfds_dir).model)
    workdir = str(tmp_path / "edited")
    shutil.copytree(ref_dir, workdir)
    path = os.path.join(workdir, run_config.CONFIG_JSON)
    with open(path) as f:
        config = json.load(f)
    config["model"].update(norm_eps=1e-5, position_convention="integer")
    with open(path, "w") as f:
        json.dump(config, f)
    edited = pathlib.Path(path).read_text()
    match = (
        r"The checkpoint at step 12 in .*/edited/checkpoints was trained with another model "
        r"than this config.model: model.norm_eps=1e-06 there, 1e-05 here; "
        r"model.position_convention='normalized' there, 'integer' here\. Set these fields back"
    )
    resumed = run_config.recipe_config(os.path.join(workdir, run_config.CONFIG_PY))
    with pytest.raises(ValueError, match=match) as raised:
        train.train_and_evaluate(resumed, workdir)
    assert errors.is_user_error(raised.value)
    assert pathlib.Path(path).read_text() == edited
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["12", "8"]
    with pytest.raises(ValueError, match=match):
        rope_lie.load(workdir)


def test_the_model_check_passes_what_computes_the_same_and_checkpoints_without_a_record():
    """``run_config.check_model``: the attention backend and Cayley-STRING's folding may
    change, as may fields one rope_lie has and the other lacks (schema changes); a value
    changed or an option key only one side has (a family's init argument) is refused. A
    checkpoint written before the record was kept (None) is not checked."""
    from configs import quickstart
    from rope_lie import run_config

    config = quickstart.get_config("smoke")
    where = "The checkpoint at step 8 in w/checkpoints"
    run_config.check_model(None, config.model, where)
    saved = run_config.model_record(config.model)
    run_config.check_model(saved, config.model, where)
    same = {**saved, "attention": "chunked", "fold_mix": False, "retired_field": 1}
    run_config.check_model(same, config.model, where)
    run_config.check_model(
        {k: v for k, v in saved.items() if k != "num_registers"}, config.model, where
    )
    for there, here, said in [
        (
            {"pe": "cayley_string", "pe_hparams": {"k": 4}},
            {"pe": "cayley_string", "pe_hparams": {"k": 2}},
            "model.pe_hparams.k=4 there, 2 here",
        ),
        (
            {"pe": "rope_mixed", "pe_hparams": {}},
            {"pe": "rope_mixed", "pe_hparams": {"rotary_fraction": 0.5}},
            "model.pe_hparams.rotary_fraction=(absent) there, 0.5 here",
        ),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"{where} was trained with another model")):
            run_config.check_model({**saved, **there}, {**saved, **here}, where)
        with pytest.raises(ValueError, match=re.escape(said)):
            run_config.check_model({**saved, **there}, {**saved, **here}, where)


def test_a_model_field_the_checkpoint_predates_passes_only_at_the_vits_default():
    """A field a newer rope_lie adds to config.model comes with the ViT argument's default, the
    model the older tree built: at that value the old checkpoint resumes, set otherwise it is
    refused (``check_model`` and ``check_resume`` alike)."""
    from configs import quickstart
    from rope_lie import run_config

    config = quickstart.get_config("smoke")
    where = "The checkpoint at step 8 in w/checkpoints"
    old = {k: v for k, v in run_config.model_record(config.model).items() if k != "norm_eps"}
    config.model.norm_eps = 1e-6  # the ViT's default
    run_config.check_model(old, config.model, where)
    config.model.norm_eps = 1e-5
    with pytest.raises(ValueError, match=r"model.norm_eps=\(absent\) there, 1e-05 here"):
        run_config.check_model(old, config.model, where)
    # an options dict the checkpoint predates, empty here, is the ViT's None: no options
    config.model.norm_eps = 1e-6
    older = run_config.model_record(config.model)
    older.pop("additive_hparams")
    config.model.additive_hparams = {}
    run_config.check_model(older, config.model, where)


def test_an_evaluation_interval_under_one_step_evaluates_every_step():
    """eval_every_epochs that rounds to 0 steps meant "only at the end" before; it is every step."""
    from configs import quickstart

    config = quickstart.get_config("smoke")
    config.total_steps, config.eval_every_steps, config.batch_size = 0, 0, 128
    config.num_epochs, config.eval_every_epochs = 3, 0.001
    assert train.schedule_steps(config, 60_000) == (1404, 468, 1)
    config.eval_every_epochs = 0.5
    assert train.schedule_steps(config, 60_000) == (1404, 468, 234)
    config.eval_every_epochs = 0.0  # off: only at the end
    assert train.schedule_steps(config, 60_000) == (1404, 468, 1404)


def test_a_damaged_config_json_is_named(tmp_path):
    from configs import quickstart
    from rope_lie import run_config

    workdir = str(tmp_path / "run")
    os.makedirs(os.path.join(workdir, "checkpoints", "8"))
    with open(os.path.join(workdir, run_config.CONFIG_JSON), "w") as f:
        f.write('{"seed": 0, "batch_size"')
    for call in (
        lambda: run_config.check_resume(workdir, quickstart.get_config("smoke")),
        lambda: run_config.read(workdir),
    ):
        with pytest.raises(ValueError, match="run/config.json is not valid JSON .Expecting"):
            call()


def test_checkpoint_meta_is_a_snapshot_of_best():
    """Orbax writes the meta in the background: the evaluations' later updates of ``run.best``
    must not reach a checkpoint saved before them."""
    from types import SimpleNamespace

    from rope_lie import loop

    run = SimpleNamespace(best={"test": {"accuracy": 0.5}}, data_shards=1, model={})
    meta = loop._meta(run, 10, {"loss": 1.0})
    run.best["test"]["accuracy"] = 0.9
    run.best["px56"] = {"accuracy": 0.1}
    assert meta["best"] == {"test": {"accuracy": 0.5}}
