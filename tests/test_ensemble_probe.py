"""The vmapped seed ensemble (experiments/studies/ensemble_probe.py) against single runs: seed
k's losses and parameters are those of the run of seed k, and different seeds differ."""

import itertools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.studies import ensemble_probe
from rope_lie import checkpoint, ensemble, fashion_mnist_files, in_memory, sharding, train

STEPS = 3
RTOL = 1e-5  # float32 rounding: the ensemble's program is not the single run's
# Parameters, absolutely: Adam divides by sqrt(v), so where a gradient is near zero its rounding
# moves that step's update by a fraction of lr (1e-3); 1e-5 is 1 % of one step (seeds differ
# by > 1e-3, test_seeds_differ).
ATOL = 1e-5
SEEDS = (3, 8)


@pytest.fixture(scope="module")
def config():
    """A pico ViT on the in-memory Fashion-MNIST input, with dropout, so that the dropout key
    (not only the initialisation and the batches) shapes the trajectory."""
    if not os.path.exists(fashion_mnist_files.idx_dir()):
        pytest.skip("Fashion-MNIST is not installed (dataset-fashion-mnist)")
    from configs import fashion_mnist

    c = fashion_mnist.get_config("pe=liere,block=8,smoke,input=memory,resolution_evals=false")
    c.model.dropout = 0.1
    c.total_steps = STEPS
    c.log_every_steps = 1
    return c


def _single_run(config, seed, mesh):
    """Losses per step and final params of seed's run from the plain jitted train step, its
    keys split as ``train._train`` splits them and its batches from the in-memory input."""
    run_config = ensemble_probe.seed_config(config, seed)
    total, _, _ = train.schedule_steps(run_config, in_memory.prepare_data(run_config))
    setup, _, init, _ = train.create_setup_and_state(run_config, mesh, total)
    init_key, dropout_key = jax.random.split(jax.random.key(seed))
    state, other = init(init_key)
    step = train.make_train_step(setup)
    batches = in_memory.data_train_batches(run_config, None, 0)
    losses = []
    for _ in range(STEPS):
        state, m = step(state, ensemble_probe.train_batch(next(batches)), other, dropout_key)
        losses.append(float(m["loss"]))
    return np.asarray(losses), jax.device_get(state["params"])


def _ensemble_run(config, seeds, mesh):
    """Losses (STEPS, S) and final stacked params of the vmapped ensemble of `seeds`."""
    built = ensemble_probe.build(config, seeds, mesh)
    members = built["members"]
    state = ensemble_probe.stack([s for s, _, _ in members])
    other = ensemble_probe.stack([o for _, o, _ in members])
    dropout_key = jnp.stack([d for _, _, d in members])
    batches = ensemble_probe.ensemble_batches(built["configs"], mesh)
    losses = []
    for _ in range(STEPS):
        state, m = built["ensemble_step"](state, next(batches), other, dropout_key)
        losses.append(np.asarray(m["loss"]))
    return np.stack(losses), jax.device_get(state["params"])


@pytest.fixture(scope="module")
def runs(config):
    mesh = sharding.make_mesh(config.mesh)
    with jax.set_mesh(mesh):
        singles = [_single_run(config, s, mesh) for s in SEEDS]
        together = _ensemble_run(config, SEEDS, mesh)
    return singles, together


def _by_path(tree) -> dict[str, np.ndarray]:
    """Leaves by their key path, dict keys as strings (Orbax restores list indices as "0")."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(str(getattr(k, "key", k)) for k in path): x for path, x in leaves}


def _assert_params_close(actual, expected):
    actual, expected = _by_path(actual), _by_path(expected)
    assert actual.keys() == expected.keys()
    for name, x in actual.items():
        np.testing.assert_allclose(x, expected[name], rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("k", range(len(SEEDS)))
def test_member_is_its_single_run(runs, k):
    singles, (losses_TS, params_S) = runs
    single_losses, single_params = singles[k]
    np.testing.assert_allclose(losses_TS[:, k], single_losses, rtol=RTOL)
    _assert_params_close(ensemble.unstack(params_S, k), single_params)


def test_scanned_steps_are_the_ensemble_steps(config, runs):
    """The probe's K-steps-a-call ensemble (``make_scanned_step``) ends where STEPS single
    ensemble steps on the same batches end: same losses at its last step, same parameters."""
    _, (losses_TS, params_S) = runs
    mesh = sharding.make_mesh(config.mesh)
    with jax.set_mesh(mesh):
        built = ensemble_probe.build(config, SEEDS, mesh)
        state, other, dropout_key = ensemble_probe.ensemble_state(built)
        batches = ensemble_probe.ensemble_batches(built["configs"], mesh)
        batches_KS = ensemble_probe.stack([next(batches) for _ in range(STEPS)])
        scanned = ensemble_probe.make_scanned_step(built["setup"], STEPS)
        state, m = scanned(state, batches_KS, other, dropout_key)
    np.testing.assert_allclose(np.asarray(m["loss"]), losses_TS[-1], rtol=RTOL)
    _assert_params_close(jax.device_get(state["params"]), params_S)


def test_seeds_differ(runs):
    """Two seeds' trajectories differ by far more than the tolerance above, so a seed axis that
    mixed up or duplicated seeds fails it. Step 1's loss is log(10) for every seed (the
    classifier starts at zero); from step 2 on the losses differ."""
    singles, (losses_TS, params_S) = runs
    for a, b in ((singles[0][0], singles[1][0]), (losses_TS[:, 0], losses_TS[:, 1])):
        assert np.all(np.abs(a[1:] - b[1:]) > 10 * RTOL * np.abs(a[1:])), (a, b)
    deltas = [np.max(np.abs(x[0] - x[1])) for x in jax.tree.leaves(params_S)]
    assert max(deltas) > 1e-3


def test_member_is_the_real_run(config, tmp_path, runs):
    """Seed k of the ensemble is ``train.train_and_evaluate``'s run of seed k (its per-step
    losses in metrics.jsonl and its checkpointed parameters): keys, init and batches are the
    ones the training job uses."""
    k = 1
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(ensemble_probe.seed_config(config, SEEDS[k]), workdir)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    losses = [r["loss"] for r in logged if "loss" in r]
    _, (losses_TS, params_S) = runs
    np.testing.assert_allclose(losses_TS[:, k], losses, rtol=RTOL)
    step, state = checkpoint.load_state(os.path.join(workdir, "checkpoints"))
    assert step == STEPS
    _assert_params_close(ensemble.unstack(params_S, k), state["params"])


def test_device_input_is_the_host_input(config):
    """The device-made stacked batches are the members' in-memory batches, across an epoch's
    end (batch 468 of 128 straddles epochs 0 and 1 of the 60,000 examples)."""
    configs = [ensemble_probe.seed_config(config, s) for s in SEEDS]
    for c in configs:
        c.batch_size = 128
    start, count = 467, 3
    mesh = sharding.make_mesh(config.mesh)
    host = ensemble_probe.ensemble_batches(configs, mesh, start)
    device = ensemble_probe.device_batches(configs, mesh, start, chunk=2)
    for _ in range(count):
        expected, actual = next(host), next(device)
        np.testing.assert_array_equal(actual["label"], expected["label"])
        np.testing.assert_allclose(actual["image"], expected["image"], rtol=RTOL, atol=1e-6)
        assert not np.array_equal(actual["label"][0], actual["label"][1])


# --------------------------------------------------------------------------- the command line

PROBE_CONFIG = "configs/fashion_mnist.py:pe=liere,block=8,smoke,input=memory,resolution_evals=false"
STEP_ROWS = ("single (seeds in turn)", "ensemble (vmapped)")
STREAM_ROWS = (
    "single, single-run input",
    "ensemble, single-run inputs stacked",
    "ensemble, device input",
)
INPUT_ROWS = ("single-run inputs alone (batches/s)", "device input alone (batches/s)")
PHASES = (  # the lines that say what the probe is doing, in order, each with its seconds
    "loading the data into memory",
    "building the setup and 2 seeds' step-0 states",
    "making the batch pool",
    "compiling the single step",
    "compiling the ensemble step",
    "compiling the device input",
    "timing single (seeds in turn)",
)


def _probe(tmp_path, *args):
    out = str(tmp_path / "probe.json")
    seeds = ",".join(map(str, SEEDS))
    argv = ["--config", PROBE_CONFIG, "--seeds", seeds, "--out", out, *args]
    result = ensemble_probe.main(argv)
    with open(out) as f:
        return result, json.load(f)


def _assert_phase_lines(err):
    """Each phase is announced, then said with its seconds, in order, on stderr."""
    position = 0
    for phase in PHASES:
        done = re.compile(
            rf"^\[ensemble_probe +\d+\.\d s\] {re.escape(phase)}.*: \d+\.\d\d s$", re.M
        )
        match = done.search(err, position)
        assert match, (phase, err)
        assert f"] {phase}" in err[position : match.start()], (phase, "not announced before")
        position = match.end()


def test_probe_says_each_phase_and_writes_every_row(config, tmp_path, capsys):
    """Without a budget every row is timed for all its steps, the JSON keeps the probe's
    original keys (config, seeds, steps, device, rows) and says it is complete, and stderr
    has a line per phase as it starts and one with its seconds as it ends."""
    result, written = _probe(tmp_path, "--steps", "2", "--warmup", "1", "--stream")
    err = capsys.readouterr().err
    assert written == json.loads(json.dumps(result))
    assert written["config"] == PROBE_CONFIG and written["seeds"] == list(SEEDS)
    assert written["steps"] == 2 and written["device"] == jax.devices()[0].device_kind
    assert list(written["rows"]) == [*STEP_ROWS, *STREAM_ROWS, *INPUT_ROWS]
    assert all(rate > 0 and np.isfinite(rate) for rate in written["rows"].values())
    batches = written["input_batches"]
    assert batches == 20
    expected = {name: batches if name in INPUT_ROWS else 2 for name in written["rows"]}
    assert written["steps_timed"] == expected
    assert written["complete"] is True and written["skipped"] == [] and written["budget"] is None
    for phase in PHASES:  # and their seconds in the JSON
        assert any(name.startswith(phase) for name in written["phases"]), phase
    _assert_phase_lines(err)


def test_probe_times_the_ensemble_k_steps_a_call(config, tmp_path):
    """--steps-per-call K adds the scanned ensemble's row after the ensemble's, timed for whole
    calls of K steps (steps // K of them, 4 steps here)."""
    result, written = _probe(tmp_path, "--steps", "5", "--warmup", "1", "--steps-per-call", "2")
    row = ensemble_probe.scanned_row(2)
    assert list(written["rows"]) == [*STEP_ROWS, row, *INPUT_ROWS]
    assert written["steps_timed"][row] == 4 and written["steps_per_call"] == 2
    assert written["rows"][row] > 0 and np.isfinite(written["rows"][row])
    assert written["complete"] is True, written
    assert any(
        p.startswith("compiling the ensemble step 2 steps a call") for p in written["phases"]
    )


@pytest.mark.parametrize("budget", [30, 9])
def test_budget_stops_timing_and_writes_what_was_timed(
    config, tmp_path, capsys, monkeypatch, budget
):
    """With --budget the timing stops when the budget is spent, and the JSON (and the table)
    hold the rates of the steps that were timed, how many, and the rows left out. The budget's
    clock is made to advance one second per reading, so the budget is spent after a fixed
    number of readings however fast this machine steps; 50 steps are asked for, far more than
    30 readings allow. At 30 every row is cut short but timed (each may use its share of what is
    left, so the first does not spend the others'); at 9 the first row's share is one step and
    the budget is spent after it, so the rows after it are skipped."""
    ticks = itertools.count()
    monkeypatch.setattr(ensemble_probe, "clock", lambda: float(next(ticks)))
    args = ("--steps", "50", "--warmup", "1", "--budget", str(budget))
    result, written = _probe(tmp_path, *args)
    captured = capsys.readouterr()
    assert written == json.loads(json.dumps(result))
    assert written["complete"] is False and written["budget"] == budget
    assert set(written["rows"]) | set(written["skipped"]) == {*STEP_ROWS, *INPUT_ROWS}
    assert not set(written["rows"]) & set(written["skipped"])
    timed = written["steps_timed"]
    assert set(timed) == set(written["rows"])
    assert "single (seeds in turn)" in timed, "the first row was not timed at all"
    for name, steps in timed.items():
        assert 1 <= steps < (written["input_batches"] if name in INPUT_ROWS else 50), name
        assert written["rows"][name] > 0 and np.isfinite(written["rows"][name])
    assert "budget share spent after" in captured.err
    n = timed["single (seeds in turn)"]
    assert re.search(rf"single \(seeds in turn\) .*\({n} of 50\)", captured.out), captured.out
    if budget == 30:  # each row had its share: the first did not spend the others'
        assert written["skipped"] == [], written["skipped"]
    if budget == 9:
        assert written["skipped"] == [*STEP_ROWS[1:], *INPUT_ROWS]
        assert re.search(r"ensemble \(vmapped\) +skipped", captured.out), captured.out
    _assert_phase_lines(captured.err)


def test_a_run_stopped_midway_leaves_what_it_measured(config, tmp_path, monkeypatch):
    """The JSON is rewritten after every phase, so a run killed in the ensemble's timing (here
    an exception raised there) leaves the phases so far and the single row's rate."""

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed in the ensemble's timing")

    monkeypatch.setattr(ensemble_probe, "time_ensemble", killed)
    with pytest.raises(KeyboardInterrupt):
        _probe(tmp_path, "--steps", "2", "--warmup", "1")
    with open(tmp_path / "probe.json") as f:
        written = json.load(f)
    assert written["complete"] is False
    assert list(written["rows"]) == ["single (seeds in turn)"]
    assert written["rows"]["single (seeds in turn)"] > 0
    assert written["steps_timed"] == {"single (seeds in turn)": 2}
    for phase in PHASES:
        assert any(name.startswith(phase) for name in written["phases"]), phase
