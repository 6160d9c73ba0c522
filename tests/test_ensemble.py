"""The seed-ensemble trainer (rope_lie/ensemble.py): each member is written as its single run
(``train.train_and_evaluate``) writes it and equals that run to float32 rounding; a stopped
ensemble resumes as if uninterrupted; the study tools read its members; mixed arms, other
inputs and another seed set on resume are refused."""

import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rope_lie
from experiments.studies import lib
from rope_lie import checkpoint, ensemble, fashion_mnist_files, job, metrics, train
from tests import helpers

# ml_collections' config_flags loads a recipe file with importlib's deprecated load_module().
pytestmark = pytest.mark.filterwarnings(
    "ignore:the load_module\\(\\) method is deprecated:DeprecationWarning"
)

STEPS = 3
RTOL = 1e-5  # float32 rounding: the ensemble's program is not the single run's
# Parameters' absolute tolerance: measured max |diff| after 3 steps 1.5e-6 (seed 3) and 1.6e-6
# (seed 8), 8 of 75 leaves bitwise equal (the device input adds its rounding); the two
# seeds' parameters differ by > 1e-3 (test_members_differ)
ATOL = 1e-5
SEEDS = (3, 8)
ARG = "pe=liere,block=8,smoke,input=memory,resolution_evals=false"
# What the `config` fixture sets, as a command line sets it
OVERRIDES = {
    "model.dropout": 0.1,
    "total_steps": STEPS,
    "log_every_steps": 1,
    "checkpoint.every_steps": 1,
    "tensorboard": False,
}


def _set(config, path, value):
    *parents, name = path.split(".")
    node = config
    for p in parents:
        node = node[p]
    node[name] = value


@pytest.fixture(scope="module")
def config():
    """A pico ViT on the in-memory Fashion-MNIST input, with dropout, so that the dropout key
    (not only the initialisation and the batches) shapes the trajectory."""
    if not os.path.exists(fashion_mnist_files.idx_dir()):
        pytest.skip("Fashion-MNIST is not installed (dataset-fashion-mnist)")
    from configs import fashion_mnist

    c = fashion_mnist.get_config(ARG)
    for path, value in OVERRIDES.items():
        _set(c, path, value)
    return c


def _configs(config, seeds=SEEDS):
    return [ensemble.member_config(config, s) for s in seeds]


@pytest.fixture(scope="module")
def singles(config, tmp_path_factory):
    """Each seed's single run (``train.train_and_evaluate``), by seed: its workdir."""
    root = tmp_path_factory.mktemp("singles")
    out = {}
    for seed in SEEDS:
        out[seed] = str(root / f"seed{seed}")
        train.train_and_evaluate(ensemble.member_config(config, seed), out[seed])
    return out


@pytest.fixture(scope="module")
def members(config, tmp_path_factory):
    """The ensemble of SEEDS, uninterrupted: (member workdirs, ensemble dir, its result)."""
    root = tmp_path_factory.mktemp("ensemble")
    workdirs = [str(root / f"seed{s}") for s in SEEDS]
    result = ensemble.train_ensemble(_configs(config), workdirs, str(root / "ens"))
    return workdirs, str(root / "ens"), result


def _train_records(workdir):
    """metrics.jsonl's records without the throughput (a timing) and the evaluations."""
    return [
        {k: v for k, v in r.items() if k != "throughput" and "/" not in k}
        for r in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    ]


def _by_path(tree) -> dict[str, np.ndarray]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(str(getattr(k, "key", k)) for k in path): x for path, x in leaves}


def _params(workdir):
    step, state = checkpoint.load_state(os.path.join(workdir, "checkpoints"))
    assert step == STEPS
    return _by_path(state["params"])


def _assert_params_close(actual, expected, rtol=RTOL, atol=ATOL):
    assert actual.keys() == expected.keys()
    for name, x in actual.items():
        np.testing.assert_allclose(x, expected[name], rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize("k", range(len(SEEDS)))
def test_member_is_its_single_run(singles, members, k):
    """Member k's metrics.jsonl (every record field, every step), final parameters and
    final.json are its single run's, to float32 rounding; its workdir holds the same files."""
    workdirs, _, result = members
    single, member = singles[SEEDS[k]], workdirs[k]
    expected, actual = _train_records(single), _train_records(member)
    assert [r["step"] for r in actual] == [1, 2, 3]
    assert [r.keys() for r in actual] == [r.keys() for r in expected]
    logged = lambda path: [
        r.keys() for r in metrics.read_jsonl(os.path.join(path, "metrics.jsonl"))
    ]
    assert logged(member) == logged(single)  # the throughput and evaluations too
    for a, e in zip(actual, expected, strict=True):
        for key in e:
            np.testing.assert_allclose(a[key], e[key], rtol=RTOL, err_msg=f"{key} {a['step']}")
    _assert_params_close(_params(member), _params(single))
    with open(os.path.join(single, "final.json")) as f:
        single_final = json.load(f)
    assert result[k] == json.loads(json.dumps(result[k]))
    with open(os.path.join(member, "final.json")) as f:
        final = json.load(f)
    assert final == json.loads(json.dumps(result[k]))
    assert final["step"] == single_final["step"] == STEPS
    assert final["evals"].keys() == single_final["evals"].keys()
    for name, res in single_final["evals"].items():
        assert final["evals"][name].keys() == res.keys()
        assert final["evals"][name]["accuracy"] == res["accuracy"], name
        np.testing.assert_allclose(final["evals"][name]["loss"], res["loss"], rtol=RTOL)
    with np.load(os.path.join(member, "eval_examples.npz")) as a:
        with np.load(os.path.join(single, "eval_examples.npz")) as e:
            assert a.files == e.files
            for name in e.files:  # each example right or wrong as in the single run
                np.testing.assert_array_equal(a[name], e[name], err_msg=name)
    for name in ("config.json", "config.py"):  # config.py names its workdir
        with open(os.path.join(member, name)) as a, open(os.path.join(single, name)) as e:
            assert a.read().replace(member, single) == e.read(), name
    with open(os.path.join(member, ensemble.ENSEMBLE_JSON)) as f:
        assert json.load(f)["seeds"] == list(SEEDS)


def test_members_differ(members):
    """The two members' trajectories differ (a seed axis that duplicated a seed fails here);
    step 1's loss is log(10) for every seed (the classifier starts at zero)."""
    workdirs, _, _ = members
    a, b = (np.array([r["loss"] for r in _train_records(w)]) for w in workdirs)
    assert np.all(np.abs(a[1:] - b[1:]) > 10 * RTOL * np.abs(a[1:])), (a, b)


def test_study_tools_read_the_members(singles, members):
    """``lib.is_finished`` and ``lib.collect`` read a member's workdir as a run's (its tree
    column marked "+ensemble"), and ``rope_lie.load`` rebuilds its model, whose logits are the
    single run's."""
    workdirs, _, _ = members
    arm = lib.Arm(name="liere", label="LieRE", recipe="fashion_mnist", arg=ARG)
    study = lib.Study(name="probe", title="probe", arms=(arm,), evals=("test",))
    for k, seed in enumerate(SEEDS):
        assert lib.is_finished(workdirs[k])
        rows, examples = lib.collect(study, arm, seed, workdirs[k])
        single_rows, single_examples = lib.collect(study, arm, seed, singles[seed])
        assert [r.keys() for r in rows] == [r.keys() for r in single_rows]
        assert rows[0]["steps"] == STEPS and rows[0]["train_ex_per_s"] > 0
        assert examples.keys() == single_examples.keys()
        # results.csv's tree column says the ensemble trained it (no provenance.json here:
        # trained outside the runner, so no code tree before the mark)
        assert (rows[0]["tree"], single_rows[0]["tree"]) == ("+ensemble", "")
    model, loaded = rope_lie.load(workdirs[1])
    single_model, _ = rope_lie.load(singles[SEEDS[1]])
    assert loaded.seed == SEEDS[1]
    images = np.random.default_rng(0).normal(size=(4, 28, 28, 1)).astype(np.float32)
    np.testing.assert_allclose(model(images), single_model(images), rtol=1e-4, atol=1e-5)


def _run_cli(monkeypatch, argv):
    """``python -m rope_lie.ensemble ARGV`` in this process, on a fresh parse of the flags
    (as tests/test_main.py runs rope_lie.main); the exit status."""
    from absl import flags

    ensemble._define_flags()
    flags.FLAGS.unparse_flags()  # as in a new process: every flag at its default
    for name in [n for n in flags.FLAGS if n.startswith("config.")]:
        delattr(flags.FLAGS, name)  # the overrides that the last --config defined
    monkeypatch.setattr(sys, "argv", argv)  # where ml_collections reads the overrides
    return ensemble.run(argv)


class _StopAfter:
    """job.StopOnSigterm whose stop is requested at the `steps`-th step (as a SIGTERM then)."""

    steps = 1

    def __init__(self):
        self.reads, self.signal_name = 0, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    @property
    def requested(self):
        self.reads += 1
        if self.reads >= self.steps:
            self.signal_name = "SIGTERM"
            return True
        return False


def test_stopped_and_resumed_is_uninterrupted(config, members, tmp_path, monkeypatch):
    """Stopped after step 2 (SIGTERM), its step-2 checkpoint then removed (as a kill between the
    log line and the save leaves it), and resumed from step 1 by the command line with the same
    arguments: each member's metrics.jsonl (its step-2 line written again, not twice) and
    final parameters are the uninterrupted ensemble's (the same program on the same inputs:
    equal)."""
    workdirs = [str(tmp_path / f"seed{s}") for s in SEEDS]
    ens_dir = str(tmp_path / "ens")
    with monkeypatch.context() as m:
        m.setattr(job, "StopOnSigterm", _StopAfter)
        m.setattr(_StopAfter, "steps", 2)
        stopped = ensemble.train_ensemble(_configs(config), workdirs, ens_dir)
    assert [r["step"] for r in stopped] == [2, 2] and stopped[0]["preempted"]
    assert not any(lib.is_finished(w) for w in workdirs)
    assert [r["step"] for r in _train_records(workdirs[0])] == [1, 2]
    shutil.rmtree(os.path.join(ens_dir, "checkpoints", "2"))
    argv = [
        "ensemble",
        f"--config=configs/fashion_mnist.py:{ARG}",
        *(f"--config.{k}={v}" for k, v in OVERRIDES.items()),
        f"--seeds={','.join(map(str, SEEDS))}",
        f"--workdirs={','.join(workdirs)}",
        f"--ensemble_dir={ens_dir}",
    ]
    assert _run_cli(monkeypatch, argv) == 0
    uninterrupted, _, _ = members
    for resumed, whole in zip(workdirs, uninterrupted, strict=True):
        assert _train_records(resumed) == _train_records(whole)
        _assert_params_close(_params(resumed), _params(whole), rtol=0, atol=0)


def test_killed_in_its_final_evaluations_ends_as_uninterrupted(config, members, tmp_path):
    """Killed while evaluating its last step (saved before, no step-3 record written): member
    0's workdir rerun by ``rope_lie.main``'s ``train_and_evaluate``, then the ensemble rerun;
    each member's metrics.jsonl ends as the uninterrupted ensemble's (one step-3 record, with
    its training scalars and evaluations; throughput aside, a wall-clock number)."""
    workdirs = [str(tmp_path / f"seed{s}") for s in SEEDS]
    ens_dir = str(tmp_path / "ens")
    evals = ensemble._evals

    def killed_at_the_end(ens, state, step, k, final=True):
        if step == ens.total:
            raise KeyboardInterrupt("killed while evaluating")
        return evals(ens, state, step, k, final)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(ensemble, "_evals", killed_at_the_end)
        with pytest.raises(KeyboardInterrupt):
            ensemble.train_ensemble(_configs(config), workdirs, ens_dir)
    for w in workdirs:
        assert [r["step"] for r in _train_records(w)] == [1, 2]
    train.train_and_evaluate(_configs(config)[0], workdirs[0])
    ensemble.train_ensemble(_configs(config), workdirs, ens_dir)
    uninterrupted, _, _ = members
    for resumed, whole in zip(workdirs, uninterrupted, strict=True):
        jsonl = lambda workdir: os.path.join(workdir, "metrics.jsonl")
        helpers.assert_same_records(jsonl(resumed), jsonl(whole))


def test_other_seed_set_on_resume_is_refused(config, members, tmp_path):
    """A stacked checkpoint resumes only as the same ensemble: another seed set is named."""
    _, ens_dir, _ = members
    workdirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    with pytest.raises(ValueError, match=r"seeds \[3, 8\].*not of seeds \[3, 9\]"):
        ensemble.train_ensemble(_configs(config, (3, 9)), workdirs, ens_dir)


def test_a_resume_under_another_config_is_refused(config, members, tmp_path):
    """As a single run's: a member workdir holding its finished run, or an ensemble directory
    holding the stacked checkpoint of members written under another config, refuses it (the
    members' config.json would otherwise say the new config of a run trained under both)."""
    workdirs, ens_dir, _ = members
    changed = _configs(config)
    for c in changed:
        c.optim.lr = 0.5
    with pytest.raises(ValueError, match=r"holds a checkpoint of another config: optim\.lr="):
        ensemble.train_ensemble(changed, workdirs, str(tmp_path / "another"))
    interrupted = []  # the members before their final state: config.json, no checkpoint
    for w in workdirs:
        interrupted.append(str(tmp_path / os.path.basename(w)))
        os.makedirs(interrupted[-1])
        shutil.copy(os.path.join(w, "config.json"), interrupted[-1])
    with pytest.raises(ValueError, match=r"another config: optim\.lr=.* there, 0\.5 here"):
        ensemble.train_ensemble(changed, interrupted, ens_dir)


def test_a_stacked_checkpoint_resumes_only_under_its_model(config, members, tmp_path):
    """The stacked checkpoints and each member's final one record config.model; members of a
    model that keeps the shapes but computes otherwise (another position convention), in
    workdirs without a config.json to compare, are refused by the stacked checkpoint's record."""
    from rope_lie import run_config

    workdirs, ens_dir, _ = members
    record = run_config.model_record(config.model)
    for directory in (ens_dir, *workdirs):
        meta = checkpoint.load_meta(os.path.join(directory, "checkpoints"), STEPS)
        assert meta["model"] == record
    changed = _configs(config)
    for c in changed:
        c.model.position_convention = "normalized"
    copy = shutil.copytree(ens_dir, tmp_path / "ens")
    fresh = [str(tmp_path / f"seed{s}") for s in SEEDS]
    with pytest.raises(
        ValueError,
        match=rf"stacked checkpoint at step {STEPS} in .*/ens/checkpoints was trained with "
        r"another model than this config.model: model.position_convention=",
    ):
        ensemble.train_ensemble(changed, fresh, copy)


def test_an_unreadable_stacked_checkpoint_falls_back_to_the_one_before(config, members, tmp_path):
    """The newest stacked checkpoint damaged (its meta no longer JSON): set aside, resumed from
    the step before, and the members end as the uninterrupted ensemble's, as a single run does."""
    workdirs, ens_dir, _ = members
    copy = shutil.copytree(ens_dir, tmp_path / "ens")
    with open(copy / "checkpoints" / str(STEPS) / "meta" / "metadata", "w") as f:
        f.write("{broken")
    fresh = [str(tmp_path / f"seed{s}") for s in SEEDS]
    assert [r["step"] for r in ensemble.train_ensemble(_configs(config), fresh, copy)] == [
        STEPS
    ] * 2
    assert os.path.isdir(tmp_path / "ens" / "checkpoints-unreadable" / str(STEPS))
    for resumed, whole in zip(fresh, workdirs, strict=True):
        _assert_params_close(_params(resumed), _params(whole), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("optim.lr", 1e-2, r"config\.optim\.lr differs between the members of seed 3"),
        ("model.dropout", 0.0, r"config\.model\.dropout differs"),
    ],
)
def test_members_of_other_arms_are_refused(config, tmp_path, path, value, message):
    configs = _configs(config)
    _set(configs[1], path, value)
    with pytest.raises(ValueError, match=message):
        ensemble.train_ensemble(configs, [str(tmp_path / "a"), str(tmp_path / "b")], "e")
    assert not os.path.exists(tmp_path / "a")


def test_data_seed_may_differ_and_other_inputs_are_refused(config, tmp_path):
    configs = _configs(config)
    configs[1].data_seed = 1008
    ensemble.check_members(configs, ["a", "b"])  # no error
    configs = _configs(config)
    for c in configs:
        c.input = "tfds"
    with pytest.raises(ValueError, match="input='tfds'.*input='memory'"):
        ensemble.check_members(configs, ["a", "b"])
    with pytest.raises(ValueError, match="2 seeds but 1 workdirs"):
        ensemble.check_members(_configs(config), ["a"])
    with pytest.raises(ValueError, match="repeat a seed"):
        ensemble.check_members(_configs(config, (3, 3)), ["a", "b"])


def test_command_line_user_errors(capsys, monkeypatch):
    base = ["ensemble", f"--config=configs/fashion_mnist.py:{ARG}"]
    assert _run_cli(monkeypatch, [*base, "--workdirs=a,b", "--ensemble_dir=e"]) == 2
    assert "--seeds" in capsys.readouterr().err
    argv = [*base, "--seeds=0,1", "--workdirs=a", "--ensemble_dir=e"]
    assert _run_cli(monkeypatch, argv) == 2
    assert "2 seeds but 1 workdirs" in capsys.readouterr().err


def test_a_non_finite_member_stops_the_ensemble_naming_its_seed(config, tmp_path, monkeypatch):
    """A member whose loss goes non-finite (made so here at step 2 for seed 8) stops the
    ensemble: the error names the seed, that member's final.json says "stopped" and names the
    ensemble's last good checkpoint, and the other member is left unfinished."""
    real = ensemble.make_ensemble_step

    def poisoned(setup):
        step_fn = real(setup)

        def step(state, batch, other, keys):
            bad = state["step"][1] == 1  # member 1's step 2
            state, m = step_fn(state, batch, other, keys)
            loss = m["loss"].at[1].set(jnp.where(bad, jnp.nan, m["loss"][1]))
            return state, {**m, "loss": loss, "finite": m["finite"] & jnp.isfinite(loss)}

        return step

    monkeypatch.setattr(ensemble, "make_ensemble_step", poisoned)
    workdirs = [str(tmp_path / f"seed{s}") for s in SEEDS]
    with pytest.raises(FloatingPointError, match=rf"seed 8 \({workdirs[1]}\).*step 2.*\[3\]"):
        ensemble.train_ensemble(_configs(config), workdirs, str(tmp_path / "ens"))
    with open(os.path.join(workdirs[1], "final.json")) as f:
        final = json.load(f)
    assert final["stopped"] == "non-finite" and final["step"] == 2
    assert final["last_good_checkpoint"] == 1
    assert not os.path.exists(os.path.join(workdirs[0], "final.json"))


def test_stacked_checkpoint_meta_is_a_snapshot_of_best():
    """As a single run's: the members' later ``best`` updates do not reach a saved meta."""
    from types import SimpleNamespace

    runs = [SimpleNamespace(best={"test": {"accuracy": 0.5}}, model={}) for _ in range(2)]
    meta = ensemble._Ensemble.meta(SimpleNamespace(runs=runs, seeds=[0, 1]), 10)
    runs[1].best["test"]["accuracy"] = 0.9
    assert meta["best"] == [{"test": {"accuracy": 0.5}}] * 2
