"""rope_lie/convert.py's command line: an error in what was asked is one line ``error: ...``
naming the value and what was expected, exit status 2; a bug keeps its traceback.

The errors found before PyTorch is imported (flags, the checkpoint's path, the workdir, the
model name, the overrides' syntax) are checked in this process through ``convert.cli``; those
that need PyTorch (reading the checkpoint, timm's model) in a fresh process
(``_TORCH_SIDE``): PyTorch's triton crashes a process that has loaded TensorFlow
(``rope_lie/interop/_torch_first.py``), as this test session may have.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from rope_lie import convert
from rope_lie.interop import _torch_first

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMM = ["--from=timm", "--model=vit_small_patch16_rope_224"]
TINY = "--overrides=embed_dim=64,depth=1,num_heads=2,img_size=32,patch_size=8"
HELP = r"\(python -m rope_lie.convert --help shows the flags\)"


def _one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    return lines[0]


@pytest.fixture
def paths(tmp_path) -> dict[str, str]:
    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text("{}")
    (tmp_path / "a_file").write_text("x")
    return {
        "tmp": str(tmp_path),
        "new": str(tmp_path / "new"),
        "full": str(full),
        "file": str(tmp_path / "a_file"),
    }


CASES = {  # case: (arguments with {tmp} {new} {full} {file}, the error line's pattern)
    "no_flags": (
        [],
        r"the following arguments are required: --from, --model, --checkpoint, "
        rf"--workdir {HELP}",
    ),
    "unknown_source": (
        ["--from=onnx", "--model=m", "--checkpoint=none", "--workdir={new}"],
        r"argument --from: invalid choice: 'onnx' \(choose from 'timm', 'liere'\)",
    ),
    "unknown_flag": (
        [*TIMM, "--checkpoint=none", "--workdir={new}", "--pretrained=1"],
        r"unrecognized arguments: --pretrained=1",
    ),
    "bad_mean": (
        [*TIMM, "--checkpoint=none", "--workdir={new}", "--mean=0.5,x"],
        r"argument --mean: '0.5,x' is not a list of finite numbers; expected one per "
        r"channel",
    ),
    "bad_seed": (
        [*TIMM, "--checkpoint=none", "--workdir={new}", "--seed=one"],
        r"argument --seed: invalid int value: 'one'",
    ),
    "missing_checkpoint": (
        [*TIMM, "--checkpoint={tmp}/model.pth", "--workdir={new}"],
        r"--checkpoint='.*/model\.pth': no such file; expected a timm "
        r"state_dict file \(\.safetensors or \.pth\) or 'none'",
    ),
    "checkpoint_is_a_directory": (
        [*TIMM, "--checkpoint={tmp}", "--workdir={new}"],
        r"--checkpoint='.*' is not a file; expected a timm state_dict",
    ),
    "liere_missing_checkpoint": (
        ["--from=liere", "--model=", "--checkpoint={tmp}/last.ckpt", "--workdir={new}"],
        r"--checkpoint='.*/last\.ckpt': no such file; expected a LieRE reference Lightning "
        r"checkpoint",
    ),
    "workdir_not_empty": (
        [*TIMM, "--checkpoint=none", "--workdir={full}"],
        r"--workdir='.*/full' is not empty; expected a new or empty directory",
    ),
    "workdir_is_a_file": (
        [*TIMM, "--checkpoint=none", "--workdir={file}"],
        r"--workdir='.*/a_file' is a file; expected a new or empty directory",
    ),
    "unknown_model": (
        ["--from=timm", "--model=vit_small_patch16_224", "--checkpoint=none", "--workdir={new}"],
        r"timm model 'vit_small_patch16_224' is not supported; expected one of "
        r"\('vit_small_patch16_rope_224', .*'vit_large_patch16_dinov3_qkvb'\)",
    ),
    "overrides_syntax": (
        [*TIMM, "--checkpoint=none", "--workdir={new}", "--overrides=depth"],
        r"--overrides='depth': 'depth' is not key=value; expected "
        r"timm.create_model keyword arguments",
    ),
    "overrides_for_liere": (
        ["--from=liere", "--model=", "--checkpoint=none", "--workdir={new}", "--overrides=depth=2"],
        r"--overrides='depth=2' is for --from=timm; give LieRE fields in "
        r"--model",
    ),
    "liere_unknown_field": (
        ["--from=liere", "--model=width=3", "--checkpoint=none", "--workdir={new}"],
        r"unknown LieRE reference field 'width'; expected \['channels', ",
    ),
    "liere_spec_incomplete": (
        ["--from=liere", "--model=image_size=32", "--checkpoint=none", "--workdir={new}"],
        r"LieRE reference spec 'image_size=32': .*missing .*required",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_user_error_is_one_line_and_exit_status_2(case, paths, capsys, monkeypatch):
    """Each is found before PyTorch is imported (torch and timm are made unimportable here,
    so reaching them would be a different error) and leaves no workdir behind."""
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "timm", None)
    args, pattern = CASES[case]
    assert convert.cli([a.format(**paths) for a in args]) == 2
    line = _one_error_line(capsys)
    assert re.fullmatch(f"error: {pattern}.*", line), line
    assert not os.path.exists(paths["new"])


def test_a_missing_interop_extra_is_one_line(paths, capsys, monkeypatch):
    """torch (or timm) not installed: the line names it and the install that brings it."""
    monkeypatch.setattr(_torch_first, "check", lambda: None)  # no TensorFlow question without torch
    monkeypatch.setitem(sys.modules, "torch", None)
    assert convert.cli([*TIMM, "--checkpoint=none", f"--workdir={paths['new']}"]) == 2
    assert _one_error_line(capsys) == (
        "error: python -m rope_lie.convert needs the interop extra, which is not installed (no "
        'module named \'torch\'): pip install "rope_lie[interop]" (pip install -e ".[interop]" '
        "in a clone)"
    )


def test_a_bug_keeps_its_traceback(paths, monkeypatch):
    """An error that no check of the user's input raised (here a ValueError from inside the
    conversion) is not turned into a user error: it propagates."""

    def broken(args):
        raise ValueError("an index computed wrongly")

    monkeypatch.setattr(convert, "_from_timm", broken)
    with pytest.raises(ValueError, match="an index computed wrongly"):
        convert.cli([*TIMM, "--checkpoint=none", f"--workdir={paths['new']}"])


def test_help_prints_the_usage_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_info:
        convert.cli(["--help"])
    assert exit_info.value.code == 0
    assert "Exit status: 0 when the model was converted; 2" in capsys.readouterr().out


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}


def test_the_command_prints_one_line_and_exits_2_for_a_missing_checkpoint(tmp_path):
    """``python -m rope_lie.convert`` itself (a bare FileNotFoundError traceback, status 1,
    before): the exit status and the whole of stderr."""
    missing = str(tmp_path / "model.safetensors")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rope_lie.convert",
            *TIMM,
            f"--checkpoint={missing}",
            f"--workdir={tmp_path / 'w'}",
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr == (
        f"error: --checkpoint={missing!r}: no such file; expected a timm state_dict file "
        "(.safetensors or .pth) or 'none'\n"
    )
    assert not (tmp_path / "w").exists()


# The errors that need PyTorch, each through convert.cli in one fresh process; prints
# {case: [exit status, stderr]} as JSON.
_TORCH_SIDE = """
import contextlib, io, json, os, sys
import torch
from rope_lie import convert
from rope_lie.interop import timm_eva

tmp, tiny = sys.argv[1], sys.argv[2]
kw = convert.parse_overrides(tiny.removeprefix("--overrides="))
model = timm_eva.create("vit_small_patch16_rope_224", num_classes=10, **kw)
torch.save(model.state_dict(), f"{tmp}/ten.pth")
with open(f"{tmp}/garbage.pth", "wb") as f:
    f.write(b"not a checkpoint")
with open(f"{tmp}/garbage.safetensors", "wb") as f:
    f.write(b"not a checkpoint")
torch.save([1, 2], f"{tmp}/a_list.pth")
timm = ["--from=timm", "--model=vit_small_patch16_rope_224"]
cases = {
    "garbage_pth": [*timm, f"--checkpoint={tmp}/garbage.pth", tiny],
    "garbage_safetensors": [*timm, f"--checkpoint={tmp}/garbage.safetensors", tiny],
    "not_a_state_dict": [*timm, f"--checkpoint={tmp}/a_list.pth", tiny],
    "unknown_keyword": [*timm, "--checkpoint=none", tiny + ",foo=1"],
    "unsupported_architecture": [*timm, "--checkpoint=none", tiny + ",qk_norm=True"],
    "head_differs": [*timm, f"--checkpoint={tmp}/ten.pth", tiny + ",num_classes=7"],
    "width_differs": [*timm, f"--checkpoint={tmp}/ten.pth", tiny.replace("64", "32")],
    "heads_do_not_divide": [*timm, "--checkpoint=none", tiny.replace("num_heads=2", "num_heads=3")],
    "image_not_divisible": [*timm, "--checkpoint=none", tiny.replace("img_size=32", "img_size=30")],
    "three_channel_std": [*timm, "--checkpoint=none", tiny, "--std=0.5"],
    "zero_std": [*timm, "--checkpoint=none", tiny, "--std=0.5,0,0.5"],
    "liere_from_a_timm_file": ["--from=liere", "--model=", f"--checkpoint={tmp}/ten.pth"],
    "liere_garbage": ["--from=liere", "--model=", f"--checkpoint={tmp}/garbage.pth"],
}
out = {}
for case, args in cases.items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = convert.cli(args + [f"--workdir={tmp}/{case}"])
    out[case] = [status, err.getvalue(), os.path.exists(f"{tmp}/{case}")]
print(json.dumps(out))
"""

TORCH_CASES = {  # case: what the error line says
    "garbage_pth": r"checkpoint '.*/garbage\.pth' cannot be read \(\w+: .*\); expected a timm "
    r"state_dict file",
    "garbage_safetensors": r"checkpoint '.*/garbage\.safetensors' cannot be read "
    r"\(SafetensorError: .*\); expected a timm state_dict file",
    "not_a_state_dict": r"checkpoint '.*/a_list\.pth' (cannot be read|holds no state_dict).*; "
    r"expected a timm state_dict file",
    "unknown_keyword": r"timm\.create_model\('vit_small_patch16_rope_224'\) refused the "
    r"overrides \{.*'foo': 1\} \(.*unexpected keyword argument 'foo'\); expected keyword "
    r"arguments of timm's",
    "unsupported_architecture": r"timm model: attn\.q_norm='LayerNorm', expected Identity",
    "head_differs": r"num_classes=7 \(--overrides\) but checkpoint '.*/ten\.pth' has a head of "
    r"10 classes",
    "width_differs": r"checkpoint '.*/ten\.pth' does not fit timm's 'vit_small_patch16_rope_224'"
    r" with overrides .*: tensor shapes \(checkpoint, model\)",
    "heads_do_not_divide": r"timm\.create_model\('vit_small_patch16_rope_224'\) refused the "
    r"overrides .*'num_heads': 3.*; expected keyword arguments of timm's .* that fit together",
    "image_not_divisible": r"image_shape=\(30, 30\) is not divisible by patch_size=\(8, 8\)",
    "three_channel_std": r"the converted model has 3 input channels but the normalisation has "
    r"mean=.*std=\(0\.5,\).*pass --mean and --std with 3 values",
    "zero_std": r"--std=0\.5,0\.0,0\.5: expected positive values",
    "liere_from_a_timm_file": r"not a LieRE reference state_dict: missing keys \['model\.",
    "liere_garbage": r"cannot read '.*/garbage\.pth' with torch\.load\(weights_only=True\)",
}


@pytest.fixture(scope="module")
def torch_side(tmp_path_factory) -> dict:
    if importlib.util.find_spec("timm") is None or importlib.util.find_spec("torch") is None:
        pytest.skip('needs the interop extra: pip install -e ".[interop]"')
    tmp = str(tmp_path_factory.mktemp("convert_errors"))
    result = subprocess.run(
        [sys.executable, "-c", _TORCH_SIDE, tmp, TINY],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", sorted(TORCH_CASES))
def test_an_error_found_by_pytorch_or_timm_is_one_line_and_exit_status_2(torch_side, case):
    status, stderr, workdir_left = torch_side[case]
    assert status == 2, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert re.fullmatch(f"error: {TORCH_CASES[case]}.*", lines[0]), stderr
    assert not workdir_left


def test_a_rectangular_model_says_the_square_size_it_fine_tunes_at():
    """The data pipeline makes square images: a (32, 48) px source fine-tunes at 48 x 48 px,
    on another token grid, which config.interop.notes says (and the command prints)."""
    from rope_lie.interop import workdir

    def notes(shape):
        config = workdir.converted_config(
            {"image_shape": shape}, dataset="d", mean=(0.5,), std=(0.5,), interop={"notes": ["a"]}
        )
        return config.dataset.image_size, list(config.interop.notes)

    assert notes((32, 32)) == (32, ["a"])
    size, said = notes((32, 48))
    assert size == 48 and said[0] == "a"
    assert said[1].startswith("image_shape=(32, 48) is not square: a fine-tune from this")
