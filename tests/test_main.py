"""The command line (rope_lie/main.py) as a user meets it.

A user error (bad key, value, recipe argument, model, data or workdir) must end in exactly one
line ``error: <message>`` on stderr, exit status 2, no traceback and no empty workdir. The cases
use digits:smoke (pico), which fail within seconds of starting. They run ``main.run`` in this
process, each on a fresh parse of its flags (``_run``); a child process runs one of them as a
user does, for what only a process shows (its exit status, JAX's "removed internal frames"
footer), and the listing cut short by a closed pipe.
"""

import subprocess
import sys

import pytest
from absl import flags

from rope_lie import main
from tests import helpers

# ml_collections' config_flags loads a recipe file with importlib's deprecated load_module().
pytestmark = pytest.mark.filterwarnings(
    "ignore:the load_module\\(\\) method is deprecated:DeprecationWarning"
)


@pytest.fixture
def run_main(monkeypatch, capsys):
    """``run_main(*args, tfds_dir=None)``: ``python -m rope_lie.main ARGS`` in this process, from
    the repository root, on a fresh parse of the flags; a ``CompletedProcess``."""
    monkeypatch.chdir(helpers.REPO)

    def run(*args: str, tfds_dir: str | None = None) -> subprocess.CompletedProcess:
        extra = [f"--config.dataset.data_dir={tfds_dir}"] if tfds_dir else []
        argv = ["rope_lie.main", *args, *extra]
        flags.FLAGS.unparse_flags()  # as in a new process: every flag at its default
        for name in [n for n in flags.FLAGS if n.startswith("config.")]:
            delattr(flags.FLAGS, name)  # the overrides that the last --config defined
        monkeypatch.setattr(sys, "argv", argv)  # where ml_collections reads the overrides
        capsys.readouterr()
        status = main.run(argv)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(argv, status, out, err)

    return run


def _child(*args: str) -> subprocess.CompletedProcess:
    """``python -m rope_lie.main ARGS`` in a child process, from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "rope_lie.main", *args],
        env=helpers.subprocess_env(),
        capture_output=True,
        text=True,
        cwd=helpers.REPO,
        timeout=300,
    )


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The single ``error:`` line of a failed run, after checking status and tracebacks."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "removed its internal frames" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


SMOKE = "--config=configs/digits.py:smoke,variant=pico"

CASES = {
    "misspelt key": (
        [SMOKE, "--config.totl_steps=5"],
        ["--config.totl_steps: config has no field", 'Did you mean "total_steps"'],
    ),
    "misspelt nested key": (
        [SMOKE, "--config.model.dims.widht=60"],
        ["config.model.dims has no field 'widht'", 'Did you mean "width"'],
    ),
    "unknown pe": (
        ["--config=configs/digits.py:smoke,pe=lire"],
        ["unknown pe='lire'", "liere", "ape", "sincos", "visionllama_liere", "alibi"],
    ),
    "unknown recipe argument": (
        ["--config=configs/digits.py:smoke,foo=1"],
        ["Unknown config argument 'foo'", "'pe'"],
    ),
    "missing recipe file": (
        ["--config=configs/nope.py"],
        ["no recipe file 'configs/nope.py'", "quickstart"],
    ),
    "not an int": ([SMOKE, "--config.total_steps=abc"], ["--config.total_steps=abc"]),
    "negative steps": ([SMOKE, "--config.total_steps=-5"], ["total_steps=-5: expected", ">= 1"]),
    "nan lr": ([SMOKE, "--config.optim.lr=nan"], ["optim.lr=nan: expected a finite number >= 0"]),
    "bad image shape": (
        [SMOKE, "--config.model.image_shape=(9,9)"],
        ["image_shape=(9, 9) is not divisible by patch_size=(2, 2)"],
    ),
    "odd head_dim": (  # width 30 over 2 heads: head_dim 15, RoPE needs pairs
        [
            "--config=configs/digits.py:smoke,variant=pico,pe=rope_mixed",
            "--config.model.dims.width=30",
        ],
        ["head_dim=15 must be even: rope_mixed"],
    ),
    "pe overridden alone": (  # would keep pe=ape's table: APE plus RoPE
        ["--config=configs/digits.py:smoke,pe=ape", "--config.model.pe=rope_mixed"],
        ["--config.model.pe: choose the encoder with the recipe's pe= argument"],
    ),
    "recipe argument that does nothing": (
        ["--config=configs/digits.py:smoke,pe=ape,block=8"],
        ["block=8 does nothing here: it needs pe=liere"],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_user_error_is_one_line_with_status_2_and_no_workdir(case, tmp_path, run_main):
    args, expected = CASES[case]
    workdir = tmp_path / "run"
    line = _one_error_line(run_main(*args, f"--workdir={workdir}"))
    for text in expected:
        assert text in line, (text, line)
    assert not workdir.exists()


def test_a_missing_dataset_is_one_line_and_leaves_no_empty_workdir(tfds_dir, tmp_path, run_main):
    workdir = tmp_path / "run"
    proc = run_main(
        SMOKE, "--config.evals.size8.name=mnistt", f"--workdir={workdir}", tfds_dir=tfds_dir
    )
    line = _one_error_line(proc)
    assert "mnistt" in line and "mnist" in line.split("mnistt", 1)[1] and len(line) < 400, line
    assert not workdir.exists()


def test_an_unwritable_workdir_is_one_line(tmp_path, run_main):
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = _one_error_line(run_main(SMOKE, f"--workdir={blocker}/run"))
    assert f"workdir '{blocker}/run'" in line


def test_help_list_and_print_config_exit_0_and_an_invalid_printed_config_2(run_main):
    help_ = run_main("--help")
    assert (
        help_.returncode == 0 and "--print_config" in help_.stdout and "quickstart" in help_.stdout
    )
    listing = run_main("--list")
    assert listing.returncode == 0, listing.stderr[-2000:]
    lines = listing.stdout.splitlines()
    assert any(line.split()[:2] == ["quickstart", "Quickstart:"] for line in lines), lines
    for name in ("visionllama_liere", "ape", "sincos", "cayley_string", "alibi"):
        assert name in listing.stdout
    printed = run_main("--config=quickstart:smoke", "--config.optim.lr=0.005", "--print_config")
    assert printed.returncode == 0, printed.stderr[-2000:]
    assert "lr: 0.005" in printed.stdout and "total_steps: 8" in printed.stdout
    # printed, to look at, but a config a run would refuse does not exit 0
    refused = run_main("--config=quickstart:smoke", "--config.num_epochs=-3", "--print_config")
    assert "num_epochs: -3.0" in refused.stdout
    assert _one_error_line(refused) == "error: num_epochs=-3.0: expected a finite number >= 0"


def test_a_listing_cut_short_by_its_reader_exits_quietly():
    """``--list | head -c 10``: the closed pipe ends the listing without a traceback."""
    cmd = f"{sys.executable} -m rope_lie.main --list | head -c 10"
    proc = subprocess.run(
        cmd,
        shell=True,
        env=helpers.subprocess_env(),
        capture_output=True,
        text=True,
        cwd=helpers.REPO,
    )
    assert proc.stdout == "Recipes (-" and proc.stderr == "", proc.stderr[-2000:]


def test_an_unexpected_error_keeps_its_traceback(tmp_path, run_main):
    """A recipe that fails with something other than a user error (here a RuntimeError) is a
    bug: it is raised, with its traceback, not printed as one line."""
    recipe = tmp_path / "broken.py"
    recipe.write_text("def get_config(arg=None):\n    raise RuntimeError('bug in the recipe')\n")
    with pytest.raises(RuntimeError, match="bug in the recipe"):
        run_main(f"--config={recipe}", f"--workdir={tmp_path / 'run'}")


def test_in_a_child_process_a_user_error_is_one_line_status_2_and_no_workdir(tmp_path):
    """The command line as a process: a model error found while training starts (JAX loaded)
    exits with status 2 and one line, without JAX's frames footer or a traceback."""
    args, expected = CASES["odd head_dim"]
    workdir = tmp_path / "run"
    line = _one_error_line(_child(*args, f"--workdir={workdir}"))
    assert all(text in line for text in expected), line
    assert not workdir.exists()
